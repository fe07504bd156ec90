"""A reward model behind `mcore-rl serve --is-embedding`: SGLang's reward-model API (aiohttp).

SGLang serves a reward model (a `*ForSequenceClassification` checkpoint) when launched with
`--is-embedding`, and scores it on its native `/classify` route (`entrypoints/http_server.py:
classify_request`, the arguments and replies of `/encode`, an `EmbeddingReqInput`):

    POST /classify (also PUT)   {"input_ids": [[ids], ...]} or {"text": [...]} (one row: a flat list / a string)
                                -> [{"embedding": [score per label], "meta_info": {...}}, ...] (one row: the object)
    GET  /health, /health_generate, /model_info, /get_model_info ("is_generation": false), /server_info
    POST /tokenize, /detokenize                 SGLang's tokenizer routes (served for every model)

A row's scores are the classifier's logits at its last token (HF's pooling), as the in-trainer head
(`rewards/reward_model.py`) computes them (`hf/classifier.py`). The tokenizer is the model
directory's (or `--tokenizer-path`), else the bundled byte tokenizer when the vocabulary fits, as
`mcore-rl serve` loads a policy's; the tokenizer routes let the trainer check, before training,
that the served model reads the policy's tokens (`check_served_reward_model`, as engine teachers
are checked). A request is one right-padded forward; requests run one
at a time on the model's thread. A bad request (an id outside the vocabulary, an empty row, text
without a tokenizer) gets SGLang's 400 and the server serves on. The generation routes are not
served by a reward model (404), as in SGLang.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from aiohttp import web

import mcore_rl
from mcore_rl.hf.classifier import last_token_scores
from mcore_rl.rollout import openai_api
from mcore_rl.rollout.launch_flags import ServerArgs
from mcore_rl.rollout.protocol import RequestError, check_fields, show
from mcore_rl.rollout.server import _body, _errors, _json, auth_middleware

logger = logging.getLogger(__name__)

# EmbeddingReqInput's fields: the rows, and routing / bookkeeping fields that change no score
_ROWS = {"input_ids", "text"}
_IGNORED: dict[str, tuple[type, ...]] = {
    "rid": (str, list),
    "model": (str,),
    "sampling_params": (dict, list),
    "priority": (int,),
    "log_metrics": (bool,),
    "http_worker_ipc": (str,),
}
_UNSUPPORTED = {"image_data", "video_data", "audio_data", "input_embeds", "lora_path", "dimensions"}


class ClassifierServer:
    """The aiohttp application serving one HF sequence classifier on SGLang's reward-model routes."""

    def __init__(self, model: Any, tokenizer: Any, args: ServerArgs, device: str = "cpu") -> None:
        self.model = model  # a transformers *ForSequenceClassification, eval mode
        self.tokenizer = tokenizer  # for `text` rows; None: input_ids only
        self.args = args
        self.device = device
        config = model.config
        self.vocab_size: int = int(config.vocab_size)
        self.num_labels: int = int(config.num_labels)
        self.pad_id: int = int(config.pad_token_id)
        self.context_length: int = int(args.context_length or getattr(config, "max_position_embeddings", 0) or 1 << 20)
        self._model_thread = ThreadPoolExecutor(1, thread_name_prefix="mcore-rl-classify")
        self.app = web.Application(middlewares=[auth_middleware(args.api_key, args.admin_api_key), _errors])
        get, post = web.get, web.post
        self.app.add_routes(
            [
                get("/health", self.health),
                get("/health_generate", self.health),
                get("/get_model_info", self.model_info),
                get("/model_info", self.model_info),
                get("/get_server_info", self.server_info),
                get("/server_info", self.server_info),
                post("/classify", self.classify),
                web.put("/classify", self.classify),
                post("/tokenize", self.tokenize),
                post("/v1/tokenize", self.tokenize),
                post("/detokenize", self.detokenize),
                post("/v1/detokenize", self.detokenize),
            ]
        )

    # ---- info ----------------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        return _json(
            {
                "model_path": self.args.model_path,
                "tokenizer_path": self.args.tokenizer_path or self.args.model_path,
                "is_generation": False,
                "preferred_sampling_params": None,
                "weight_version": self.args.weight_version,
                "model_type": getattr(self.model.config, "model_type", None),
                "architectures": getattr(self.model.config, "architectures", None),
            }
        )

    async def server_info(self, request: web.Request) -> web.Response:
        return _json(
            {
                **self.args.to_dict(),
                "context_length": self.context_length,
                "vocab_size": self.vocab_size,
                "num_labels": self.num_labels,
                "version": mcore_rl.__version__,
                "engine": "mcore-rl embedded (reward model)",
            }
        )

    # ---- tokenizer -----------------------------------------------------------------------------

    def _tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise RequestError("this reward model has no tokenizer here (pass --tokenizer-path); send input_ids")
        return self.tokenizer

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await _body(request)
        return _json(openai_api.tokenize(body, tokenizer=self._tokenizer(), context_length=self.context_length))

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await _body(request)
        return _json(openai_api.detokenize(body, tokenizer=self._tokenizer(), vocab_size=self.vocab_size))

    # ---- scoring -------------------------------------------------------------------------------

    async def classify(self, request: web.Request) -> web.Response:
        start = time.monotonic()
        body = await _body(request)
        rows, single = self.rows(body)
        loop = asyncio.get_running_loop()
        scores = await loop.run_in_executor(self._model_thread, self.forward, rows)
        rids = body.get("rid")
        out = []
        for i, (row, score) in enumerate(zip(rows, scores.tolist())):
            rid = rids[i] if isinstance(rids, list) and i < len(rids) else (rids if single else None)
            meta = {
                "id": rid or uuid.uuid4().hex,
                "finish_reason": {"type": "length", "length": 0},
                "prompt_tokens": len(row),
                "weight_version": self.args.weight_version,
                "e2e_latency": time.monotonic() - start,
            }
            out.append({"embedding": score, "meta_info": meta})
        return _json(out[0] if single else out)

    def rows(self, body: dict) -> tuple[list[list[int]], bool]:
        """The token rows of an `EmbeddingReqInput` body, checked, and whether it was one row."""
        check_fields(body, _ROWS, _IGNORED, _UNSUPPORTED)
        if ("input_ids" in body) == ("text" in body):
            raise RequestError("input_ids, text: exactly one of them is required")
        if "text" in body:
            rows, single = self._text_rows(body["text"])
        else:
            ids = body["input_ids"]
            single = isinstance(ids, list) and bool(ids) and not isinstance(ids[0], list)
            rows = [ids] if single else ids
            if not isinstance(rows, list) or not rows:
                raise RequestError(f"input_ids: expected a list of token ids or a list of such lists, got {show(ids)}")
        for i, row in enumerate(rows):
            where = "input_ids" if single else f"input_ids[{i}]"
            if not isinstance(row, list) or not row:
                raise RequestError(f"{where}: expected a non-empty list of token ids, got {show(row)}")
            for t in row:
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                    raise RequestError(f"{where}: token id {show(t)} is outside the vocabulary of {self.vocab_size}")
            if len(row) > self.context_length:
                raise RequestError(f"{where}: {len(row)} tokens exceed the context length {self.context_length}")
        return rows, single

    def _text_rows(self, text: Any) -> tuple[list[list[int]], bool]:
        if self.tokenizer is None:
            raise RequestError("text: this reward model has no tokenizer here; send input_ids")
        single = isinstance(text, str)
        texts = [text] if single else text
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise RequestError(f"text: expected a string or a list of strings, got {show(text)}")
        return [list(self.tokenizer.encode(t)) for t in texts], single

    def forward(self, rows: list[list[int]]) -> torch.Tensor:
        """[rows, num_labels] scores, each at its row's last token (`hf/classifier.py`, as the trainer's head)."""
        return last_token_scores(self.model, rows, self.pad_id, self.device)

    def close(self, timeout: float = 30.0) -> None:
        """Stop taking forwards (one in flight finishes on its thread)."""
        self._model_thread.shutdown(wait=False, cancel_futures=True)


def build_classifier_server(args: ServerArgs) -> ClassifierServer:
    """Load `--model-path` as a HF sequence classifier (`--is-embedding`); a directory that is not one
    is refused with a message saying what it is."""
    from transformers import AutoConfig, AutoModelForSequenceClassification  # lazy: transformers is slow to import

    path = args.model_path
    if not path or not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"--is-embedding needs --model-path, a HF reward-model directory; {path!r} has no config.json")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    arch = (config.architectures or ["?"])[0]
    if not arch.endswith("ForSequenceClassification"):
        raise ValueError(
            f"--model-path {path}: {arch} is not a reward model (a *ForSequenceClassification; "
            "`mcore-rl convert mcore-to-hf` exports one from `mcore-rl rm-train`)"
        )
    if config.pad_token_id is None:
        raise ValueError(f"{path}/config.json: pad_token_id is not set; the classifier pools at it")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = AutoModelForSequenceClassification.from_pretrained(path, local_files_only=True).to(device).eval()
    from mcore_rl.rollout.engine.core import load_path_tokenizer  # lazy: the engine's modules

    try:
        tokenizer = load_path_tokenizer(args.tokenizer_path or path, int(config.vocab_size))[0]
    except ValueError as err:  # no tokenizer files and too small a vocabulary for the bundled one
        logger.warning("reward model %s: no tokenizer (%s); /tokenize and text rows are refused", path, err)
        tokenizer = None
    return ClassifierServer(model, tokenizer, args, device)


class RewardServerError(ValueError):
    """A served reward model the run cannot use; the message names it and what differs."""


def check_served_reward_model(url: str, tokenizer: Any, who: str, api_key: str | None = None) -> None:
    """Before training: the reward model at `url` answers, is a reward model (`is_generation`
    false), tokenizes like the policy (`teacher.py: check_tokenizer`: SGLang's `/tokenize` and
    `/detokenize`, as engine teachers are checked) and scores a row holding the policy's last id on
    `/classify`; else `RewardServerError` naming `who` (the config key) and the server. A model with
    another tokenizer would score other text than the policy wrote; one with a smaller vocabulary
    would refuse the policy's ids."""
    from mcore_rl.rollout.client import EngineClient, EngineError  # lazy: aiohttp
    from mcore_rl.rollout.teacher import check_tokenizer

    async def probe() -> str | None:
        client = EngineClient(url, timeout=30.0, retries=1, api_key=api_key)
        try:
            info = await client.get_model_info()
            if info.get("is_generation") is not False:
                return "/model_info says it is a generation model, not a reward model (serve it with --is-embedding)"
            problem = await check_tokenizer(client, tokenizer)
            if problem is not None:
                return f"it does not share the policy's tokenizer (data.tokenizer_path): {problem}"
            last = int(tokenizer.vocab_size) - 1
            reply = await client.classify(input_ids=[[last]])
            if not isinstance(reply, list) or not reply or "embedding" not in reply[0]:
                return f"/classify gave no scores for the policy's last id {last}: {str(reply)[:120]}"
            return None
        finally:
            await client.close()

    try:
        problem = asyncio.run(probe())
    except EngineError as err:
        problem = f"{type(err).__name__}: {err}"
    if problem is not None:
        raise RewardServerError(f"{who}: the reward model at {url}: {problem}"[:600])
