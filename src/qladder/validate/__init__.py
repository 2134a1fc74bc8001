"""`qladder validate`: replay real prompts through bare INT4 and the guarded ladder, find the boundaries.

    corpora.py      the normal and abnormal prompt sets (deterministic generator, JSONL files)
    fault_models.py the fault models as data: what real phenomenon each emulates, its trigger
    garbage.py      the offline judge of an answer: NaN text, U+FFFD, black squares, loops, empty
    replay.py       the two configurations (bare, guarded) and one request through each
    boundaries.py   precision sweep (gain x rung) and latency overhead per check level
    queueing.py     the availability boundary: M/M/c standby model and a seeded simulation
    stats.py        percentiles and the results.json sections
    environment.py  versions, CPU, threads, load: what every output records
    plots.py        the PNG plots (matplotlib, Agg)
    report.py       report.md and report.html
    runner.py       the whole run: phases, progress bar, output files
"""
