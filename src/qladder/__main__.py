from qladder.cli import app

app(prog_name="qladder")
