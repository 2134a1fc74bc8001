"""A remote INT4 rung: llama.cpp's `llama-server`, decoding over HTTP, checked token by token.

    rung = LlamaServerRung(info, "http://127.0.0.1:8080")   checks the server's tokenizer at start
    rung.body(context_ids, params, n_remaining)              the /completion request for a context

The vocabulary stays in-process (the same GGUF's tokenizer, `vocab_only`): prompts are sent as
token-id arrays (llama-server adds no BOS to an array), the streamed ids are checked against it,
and a handoff continues from the same ids on the next rung. At start-up a set of probe texts is
tokenized by the server and locally; any difference refuses the rung (TokenizerMismatchError).
"""

from __future__ import annotations

import httpx

from qladder.engines.llamacpp import LlamaVocab
from qladder.errors import EngineError, TokenizerMismatchError
from qladder.model import ModelInfo
from qladder.sampling import SamplingParams

PROBES = ("Hello, world!", "<|im_start|>user\nhé 🙂 — 1+1=2<|im_end|>\n", "def f(x):\n    return x ** 2",
          " \t\n spaces  and\ttabs", "日本語のテキスト", "\u200b\u00ad zero width")


class LlamaServerRung(LlamaVocab):
    name = "llama-server"
    precision = "llama.cpp's llama-server (remote): the GGUF's kernels, as served"
    remote = True

    def __init__(self, info: ModelInfo, base_url: str, n_probs: int = 4, timeout_s: float = 10.0):
        super().__init__(info)
        self.base_url = base_url.rstrip("/")
        self.n_probs = n_probs
        try:
            props = httpx.get(f"{self.base_url}/props", timeout=timeout_s).json()
            self.n_ctx = int(props["default_generation_settings"]["n_ctx"])
            self.n_slots = int(props.get("total_slots", 1))
            self.server_model = str(props.get("model_path", ""))
            self.build = str(props.get("build_info", ""))
            self._check_tokenizer(timeout_s)
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            self.close()
            raise EngineError(f"llama-server at {self.base_url} cannot be used: {exc!r}") from exc
        except TokenizerMismatchError:
            self.close()
            raise

    def _check_tokenizer(self, timeout_s: float) -> None:
        for text in PROBES:
            r = httpx.post(f"{self.base_url}/tokenize", json={"content": text, "parse_special": True},
                           timeout=timeout_s)
            r.raise_for_status()
            theirs, ours = r.json()["tokens"], self.tokenize(text, True)
            if theirs != ours:
                raise TokenizerMismatchError(
                    f"llama-server at {self.base_url} tokenizes {text!r} as {theirs[:12]}, this model as "
                    f"{ours[:12]}: a handoff by token ids would change the text; refusing the rung")

    def body(self, ids: list[int], params: SamplingParams, n_remaining: int) -> dict[str, object]:
        """The /completion request that continues `ids`: the server samples with the request's own
        settings (its extra samplers off), and streams each token with its top-k logprobs."""
        return {"prompt": ids, "n_predict": n_remaining, "stream": True, "return_tokens": True,
                "n_probs": max(self.n_probs, params.logprobs or 0), "temperature": params.temperature,
                "top_p": params.top_p, "top_k": params.top_k, "min_p": 0.0, "seed": params.seed % (2**32),
                "repeat_penalty": 1.0, "cache_prompt": True, "ignore_eos": params.ignore_eos}
