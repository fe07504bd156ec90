"""The embedded server against SGLang's own definitions (docs/serving.md), over raw
HTTP on loopback (the `openai` package is not installed here): rendezvous timeouts and SIGTERM,
API keys and the directories weight files may come from, `n` > 1 order and ids, every SGLang
field at its default, string weight versions, the tokenizer / load / model / weight / memory
endpoints, and SGLang's up-front length checks. Servers are real `EngineServer`s on threads (one
`mcore-rl serve` process for SIGTERM) with the built-in tiny demo model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from mcore_rl.rollout.engine.driver import EngineDriver
from mcore_rl.rollout.launch_flags import ServerArgs, default_weight_dirs, parse_server_args
from mcore_rl.rollout.server import ADMIN_PATHS, EngineServer, ServerThread, request_allowed
from mcore_rl.rollout.weight_protocol import encode_named_tensors, encode_tensor_file
from tests.helpers import CONTEXT, LONG, _core, _free_port, _greedy


def call(
    url: str,
    path: str,
    body: Any = None,
    *,
    method: str = "POST",
    headers: dict | None = None,
    raw: bytes | None = None,
    timeout: float = 60,
) -> tuple[int, Any]:
    """(status, decoded JSON body or text) of one request; HTTP errors are returned, not raised."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(
        url + path, data=data, method=method, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, payload = resp.status, resp.read()
    except urllib.error.HTTPError as err:
        status, payload = err.code, err.read()
    try:
        return status, json.loads(payload) if payload else None
    except ValueError:
        return status, payload.decode()


def stream(url: str, path: str, body: dict, timeout: float = 60) -> list[dict]:
    """The events of a server-sent-event response, up to [DONE]."""
    req = urllib.request.Request(
        url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    events = []
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for line in resp:
            line = line.strip()
            if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                events.append(json.loads(line[5:]))
    return events


def in_background(fn, *args, **kwargs) -> dict:
    """Run fn(*args, **kwargs) on a thread; the dict gets "result" (or "error") and "thread"."""
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = fn(*args, **kwargs)
        except Exception as err:
            box["error"] = err

    box["thread"] = threading.Thread(target=run, daemon=True)
    box["thread"].start()
    return box


def wait_until(cond, timeout: float = 20.0) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "timed out waiting"
        time.sleep(0.01)


def _serve(args: ServerArgs | None = None) -> ServerThread:
    return ServerThread(EngineServer(EngineDriver(_core()), args)).__enter__()


@pytest.fixture(scope="module")
def server():
    srv = _serve()
    yield srv
    srv.stop()


def _closed_port() -> int:
    return _free_port()  # nobody listens there once the probe socket is closed


# --- item 4: rendezvous timeout, SIGTERM ----------------------------------------------------------


def test_rendezvous_timeout_is_set_by_the_request(server) -> None:
    group = dict(master_address="127.0.0.1", master_port=_closed_port(), rank_offset=1, world_size=2, backend="gloo")
    t0 = time.monotonic()
    status, reply = call(server.url, "/init_weights_update_group", {**group, "timeout_s": 1}, timeout=30)
    assert status == 400 and reply["success"] is False and "within 1 s" in reply["message"], reply
    assert time.monotonic() - t0 < 15
    status, reply = call(server.url, "/init_weights_update_group", {**group, "timeout_s": 0})
    assert status == 400 and reply["message"].startswith("timeout_s:")
    # the failed group name is free again, and the server goes on serving
    assert call(server.url, "/generate", {"text": "x", "sampling_params": _greedy(2)})[0] == 200


def test_sigterm_stops_the_server_while_a_rendezvous_and_a_request_hang() -> None:
    port = _free_port()
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mcore_rl.cli", "serve", "--port", str(port), "--context-length", "4096"],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=log,
        stderr=log,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _healthy(url), timeout=120)
        group = dict(
            master_address="127.0.0.1",
            master_port=_closed_port(),
            rank_offset=1,
            world_size=2,
            backend="gloo",
            timeout_s=600,
        )
        rendezvous = in_background(call, url, "/init_weights_update_group", group, timeout=120)
        generation = in_background(call, url, "/generate", {"text": "x", "sampling_params": _greedy(4000)}, timeout=120)
        time.sleep(1.5)  # both are in the server now
        assert "result" not in rendezvous and "error" not in generation
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=15)
        assert time.monotonic() - t0 < 6, "SIGTERM took too long"
    finally:
        proc.kill()
        proc.wait()
        log.close()


def _healthy(url: str) -> bool:
    try:
        return call(url, "/health", method="GET", timeout=2)[0] == 200
    except OSError:
        return False


# --- item 14: API keys ----------------------------------------------------------------------------


def test_auth_decisions_follow_sglang() -> None:
    def ok(
        path: str,
        api: str | None,
        admin: str | None,
        bearer: str | None = None,
        x_key: str | None = None,
        method: str = "POST",
    ) -> bool:
        return request_allowed(method, path, None if bearer is None else f"Bearer {bearer}", x_key, api, admin)

    assert ok("/generate", None, None) and ok("/update_weights_from_disk", None, None)  # no keys: open
    for path in ("/health", "/health_generate"):
        assert ok(path, "k", "a")
    assert ok("/generate", "k", "a", method="OPTIONS")
    # api key only: it guards everything, admin paths included
    assert not ok("/generate", "k", None) and ok("/generate", "k", None, "k") and ok("/generate", "k", None, x_key="k")
    assert not ok("/generate", "k", None, "wrong") and ok("/pause_generation", "k", None, "k")
    assert request_allowed("POST", "/generate", "bearer k", None, "k", None)  # scheme is case-insensitive
    # admin key only: normal paths open, admin paths need it
    assert ok("/generate", None, "a") and not ok("/abort_request", None, "a") and ok("/abort_request", None, "a", "a")
    # both: the api key does not open admin paths, the admin key does not open normal ones
    assert not ok("/update_weights_from_tensor", "k", "a", "k") and ok("/update_weights_from_tensor", "k", "a", "a")
    assert not ok("/generate", "k", "a", "a") and ok("/generate", "k", "a", "k")
    assert {
        "/update_weights_from_disk",
        "/init_weights_update_group",
        "/destroy_weights_update_group",
        "/update_weight_version",
        "/pause_generation",
        "/continue_generation",
        "/abort_request",
        "/flush_cache",
        "/release_memory_occupation",
        "/resume_memory_occupation",
    } <= ADMIN_PATHS


def test_api_keys_on_a_live_server(tmp_path) -> None:
    args = parse_server_args(["--api-key", "user-key", "--admin-api-key", "admin-key"])
    assert args.api_key == "user-key" and args.admin_api_key == "admin-key"
    srv = _serve(args)
    user, admin = {"Authorization": "Bearer user-key"}, {"Authorization": "Bearer admin-key"}
    try:
        url = srv.url
        assert call(url, "/health", method="GET")[0] == 200 and call(url, "/health_generate", method="GET")[0] == 200
        body = {"text": "x", "sampling_params": _greedy(2)}
        assert call(url, "/generate", body) == (401, {"error": "Unauthorized"})
        assert call(url, "/generate", body, headers={"Authorization": "Bearer nope"})[0] == 401
        assert call(url, "/generate", body, headers=user)[0] == 200
        assert call(url, "/generate", body, headers={"x-api-key": "user-key"})[0] == 200
        assert call(url, "/v1/models", method="GET")[0] == 401 and call(url, "/get_server_info", method="GET")[0] == 401
        info = call(url, "/get_server_info", method="GET", headers=user)[1]
        assert info["api_key"] == info["admin_api_key"] == "<set>" and "admin-key" not in json.dumps(info)
        # the weight and control endpoints take the admin key only
        save_file({"model.norm.weight": torch.ones(64)}, str(tmp_path / "m.safetensors"))
        for path, req in [
            ("/update_weights_from_disk", {"model_path": str(tmp_path)}),
            ("/pause_generation", {}),
            ("/abort_request", {"abort_all": True}),
            ("/update_weight_version", {"new_version": "x"}),
        ]:
            assert call(url, path, req)[0] == 401 and call(url, path, req, headers=user)[0] == 401, path
        assert call(url, "/update_weights_from_disk", {"model_path": str(tmp_path)}, headers=admin)[1]["success"]
        assert call(url, "/pause_generation", {}, headers=admin)[0] == 200
        assert call(url, "/continue_generation", {}, headers=admin)[0] == 200
        assert call(url, "/generate", body, headers=admin)[0] == 401  # the admin key is not the api key
    finally:
        srv.stop()


# --- item 14: weight files only from --weight-dirs ----------------------------------------------


def test_weight_files_only_from_the_allowed_directories() -> None:
    assert ServerArgs().allowed_weight_dirs == default_weight_dirs(None) == [tempfile.gettempdir(), "/dev/shm"]
    assert ServerArgs(model_path="/m").allowed_weight_dirs[0] == "/m"
    assert parse_server_args(["--weight-dirs", "/a", "/b"]).allowed_weight_dirs == ["/a", "/b"]
    assert parse_server_args(["--weight-dirs"]).allowed_weight_dirs == []
    with tempfile.TemporaryDirectory() as allowed, tempfile.TemporaryDirectory() as outside:
        srv = _serve(ServerArgs(weight_dirs=[allowed]))
        core = srv.server.core
        try:
            norm = core.model.model.norm.weight
            before = norm.detach().clone()
            good = {"model.norm.weight": torch.full((64,), 2.0)}
            os.makedirs(os.path.join(allowed, "ckpt"))
            save_file(good, os.path.join(allowed, "ckpt", "model.safetensors"))
            save_file(good, os.path.join(outside, "model.safetensors"))
            os.symlink(outside, os.path.join(allowed, "link"))

            def refused(path: str, field: str, **req) -> str:
                status, reply = call(srv.url, path, req)
                assert status == 400 and reply["success"] is False and reply["message"].startswith(field), reply
                return reply["message"]

            # outside: one message whether the path exists or not, and the weights stay as they were
            exists = refused("/update_weights_from_disk", "model_path", model_path=outside)
            missing = refused("/update_weights_from_disk", "model_path", model_path=outside + "-nowhere")
            assert exists.replace(outside, "P") == missing.replace(outside + "-nowhere", "P")
            assert "--weight-dirs" in exists
            refused("/update_weights_from_disk", "model_path", model_path=os.path.join(allowed, "link"))  # symlink out
            refused(
                "/update_weights_from_disk",
                "model_path",
                model_path=os.path.join(allowed, "..", os.path.basename(outside)),
            )
            field = "serialized_named_tensors[0]"
            file_msgs = [
                refused("/update_weights_from_tensor", field, serialized_named_tensors=[encode_tensor_file(p)])
                for p in (os.path.join(outside, "model.safetensors"), "/etc/passwd", "/nonexistent/x")
            ]
            assert len({m.split("'")[0] + m.split("'")[-1] for m in file_msgs}) == 1
            assert torch.equal(norm, before)
            # inside: loaded
            assert call(srv.url, "/update_weights_from_disk", {"model_path": os.path.join(allowed, "ckpt")})[1][
                "success"
            ]
            assert torch.equal(norm, torch.full((64,), 2.0))
            # no directories at all
            srv.server.weight_dirs = []
            assert "reads no weight files" in refused(
                "/update_weights_from_disk", "model_path", model_path=os.path.join(allowed, "ckpt")
            )
        finally:
            srv.stop()


# --- item 15: n > 1 ---------------------------------------------------------------------------


def test_parallel_samples_are_prompt_major_with_their_own_ids(server) -> None:
    body = {"text": ["a", "bbb"], "rid": "r", "sampling_params": {"n": 2, "max_new_tokens": 3, "temperature": 0.0}}
    status, outs = call(server.url, "/generate", body)
    assert status == 200 and [o["meta_info"]["prompt_tokens"] for o in outs] == [1, 1, 3, 3]
    assert outs[0]["output_ids"] == outs[1]["output_ids"] and outs[2]["output_ids"] == outs[3]["output_ids"]
    ids = [o["meta_info"]["id"] for o in outs]
    assert len(set(ids)) == 4 and not any(i.startswith("r") and "_" in i for i in ids)  # SGLang regenerates them
    events = stream(server.url, "/generate", {**body, "stream": True})
    last = {}
    for e in events:
        last[e["index"]] = e
    assert [last[i]["meta_info"]["prompt_tokens"] for i in range(4)] == [1, 1, 3, 3]
    status, err = call(server.url, "/generate", {**body, "return_logprob": [True, False]})
    assert status == 400 and "parallel_sample_num" in err["error"]["message"]


# --- item 16: every SGLang field at its default ---------------------------------------------------

GENERATE_DEFAULTS = {
    "session_id": None,
    "input_embeds": None,
    "image_data": None,
    "video_data": None,
    "audio_data": None,
    "mm_hashes": None,
    "mm_content_hashes": None,
    "use_audio_in_video": False,
    "video_config": None,
    "return_logprob": None,
    "logprob_start_len": None,
    "top_logprobs_num": None,
    "token_ids_logprob": None,
    "return_sampling_mask": False,
    "return_text_in_logprobs": False,
    "return_flat_raw_top_logprobs": False,
    "return_flat_raw_top_logprobs_b64": False,
    "stream": False,
    "log_metrics": True,
    "return_hidden_states": False,
    "return_routed_experts": False,
    "routed_experts_start_len": 0,
    "return_indexer_topk": False,
    "modalities": None,
    "session_params": None,
    "lora_path": None,
    "lora_id": None,
    "custom_logit_processor": None,
    "positional_embed_overrides": None,
    "bootstrap_host": None,
    "bootstrap_port": None,
    "bootstrap_room": None,
    "bootstrap_pair_key": None,
    "decode_tp_size": None,
    "routed_dp_rank": None,
    "data_parallel_rank": None,
    "disagg_prefill_dp_rank": None,
    "kv_router_hint": None,
    "routing_key": None,
    "conversation_id": None,
    "http_worker_ipc": None,
    "background": False,
    "require_reasoning": False,
    "max_thinking_tokens": None,
    "priority": None,
    "extra_key": None,
    "no_logs": False,
    "custom_labels": None,
    "return_bytes": False,
    "return_entropy": False,
    "return_prompt_token_ids": False,
    "external_trace_header": None,
    "received_time": None,
    "need_wait_for_mm_inputs": None,
    "num_items_assigned": None,
    "encoder_urls": None,
    "max_dynamic_patch": None,
    "min_dynamic_patch": None,
    "image_max_dynamic_patch": None,
    "video_max_dynamic_patch": None,
    "images_config": None,
    "multi_item_delimiter_indices": None,
    "cache_salt": None,
}
CHAT_EXTRAS = {
    "chat_template_kwargs": {},
    "separate_reasoning": True,
    "continue_final_message": False,
    "stream_reasoning": True,
    "reasoning_effort": "low",
    "return_hidden_states": False,
    "lora_path": None,
    "parallel_tool_calls": True,
    "tool_choice": "auto",
    "return_routed_experts": False,
    "routed_experts_start_len": 0,
    "return_cached_tokens_details": False,
    "return_prompt_token_ids": False,
    "return_token_ids": False,
    "return_meta_info": False,
    "task": None,
    "session_id": "s",
    "session_params": None,
    "custom_params": None,
    "custom_logit_processor": None,
    "max_dynamic_patch": None,
    "min_dynamic_patch": None,
    "use_audio_in_video": False,
    "images_config": None,
    "rid": None,
    "extra_key": None,
    "cache_salt": None,
    "ngram_corpus_id": None,
    "priority": None,
    "bootstrap_host": None,
    "routed_dp_rank": None,
    "data_parallel_rank": None,
    "stop_regex": None,
    "ebnf": None,
    "regex": None,
    "top_k": None,
    "min_p": None,
    "repetition_penalty": None,
    "min_tokens": 0,
    "stream_options": {"include_usage": False, "continuous_usage_stats": False},
}


def test_every_sglang_field_at_its_default_is_accepted(server) -> None:
    body = {"text": "1+1=", "sampling_params": _greedy(3), **GENERATE_DEFAULTS}
    status, out = call(server.url, "/generate", body)
    assert status == 200, out
    assert (
        out["output_ids"]
        == call(server.url, "/generate", {"text": "1+1=", "sampling_params": _greedy(3)})[1]["output_ids"]
    )
    msgs = [{"role": "user", "content": "hi"}]
    status, chat = call(server.url, "/v1/chat/completions", {"messages": msgs, "max_tokens": 3, **CHAT_EXTRAS})
    assert status == 200, chat
    status, cmpl = call(
        server.url,
        "/v1/completions",
        {
            "prompt": "1+1=",
            "max_tokens": 3,
            "return_hidden_states": False,
            "return_token_ids": False,
            "return_cached_tokens_details": False,
            "lora_path": None,
            "suffix": None,
            "response_format": None,
            "session_id": "s",
            "custom_labels": {"team": "rl"},
            "ngram_corpus_id": None,
            "stop_regex": None,
        },
    )
    assert status == 200, cmpl
    abort = {
        "rid": "nothing-running",
        "abort_all": False,
        "finished_reason": None,
        "abort_message": None,
        "weight_versions": None,
        "http_worker_ipc": None,
    }
    assert call(server.url, "/abort_request", abort)[0] == 200


@pytest.mark.parametrize(
    "path,body,field",
    [
        ("/generate", {"text": "x", "return_hidden_states": True}, "return_hidden_states"),
        ("/generate", {"text": "x", "lora_path": "adapter"}, "lora_path"),
        ("/generate", {"text": "x", "return_sampling_mask": True}, "return_sampling_mask"),
        ("/generate", {"text": "x", "mm_hashes": ["h"]}, "mm_hashes"),
        ("/generate", {"text": "x", "routed_experts_start_len": 2}, "routed_experts_start_len"),
        ("/generate", {"text": "x", "priority": "high"}, "priority"),
        ("/generate", {"text": "x", "no_such_field": 1}, "no_such_field"),
        ("/abort_request", {"weight_versions": [[0, 1]]}, "weight_versions"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "return_hidden_states": True},
            "return_hidden_states",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "lora_path": "a"}, "lora_path"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
            "tool_choice",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "extreme"},
            "reasoning_effort",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": 3},
            "chat_template_kwargs",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
            "continue_final_message",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "stream_options": {"continuous_usage_stats": True}},
            "stream_options.continuous_usage_stats",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "not_sglang": 1}, "not_sglang"),
        ("/v1/completions", {"prompt": "x", "return_token_ids": True}, "return_token_ids"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ],
)
def test_values_the_engine_cannot_honour_are_refused_naming_the_field(server, path, body, field) -> None:
    status, err = call(server.url, path, body)
    assert status == 400 and err["error"]["message"].startswith(field), err


def test_chat_extras_change_the_prompt_as_sglang_does(server) -> None:
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "12"}]
    status, chat = call(
        server.url,
        "/v1/chat/completions",
        {"messages": msgs, "max_tokens": 4, "temperature": 0, "continue_final_message": True},
    )
    assert status == 200, chat
    prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n12"  # the last message left open
    ref = call(
        server.url,
        "/generate",
        {"text": prompt, "sampling_params": {"max_new_tokens": 4, "temperature": 0, "stop_token_ids": [260]}},
    )[1]
    assert chat["choices"][0]["message"]["content"] == ref["text"]
    ids = list(b"1+1=")
    by_ids = call(
        server.url,
        "/v1/chat/completions",
        {"messages": msgs[:1], "input_ids": ids, "max_tokens": 3, "temperature": 0, "ignore_eos": True},
    )[1]
    native = call(server.url, "/generate", {"input_ids": ids, "sampling_params": _greedy(3)})[1]
    assert by_ids["choices"][0]["message"]["content"] == native["text"] and by_ids["usage"]["prompt_tokens"] == 4


# --- item 17: string weight versions ---------------------------------------------------------------


def test_weight_versions_are_strings_and_a_version_update_aborts_by_default(tmp_path) -> None:
    srv = _serve()
    try:
        url = srv.url
        status, reply = call(url, "/update_weight_version", {"new_version": "policy-v3"})
        assert status == 200 and reply == {
            "success": True,
            "message": "Weight version updated to policy-v3",
            "new_version": "policy-v3",
        }
        assert call(url, "/get_weight_version", method="GET")[1]["weight_version"] == "policy-v3"
        out = call(url, "/generate", {"text": "x", "sampling_params": _greedy(2)})[1]
        assert out["meta_info"]["weight_version"] == "policy-v3"
        # SGLang's default abort_all_requests=true cuts what is running ...
        running = in_background(call, url, "/generate", {"text": "long", "sampling_params": _greedy(LONG)})
        wait_until(lambda: srv.server.core.num_running_reqs == 1)
        assert call(url, "/update_weight_version", {"new_version": "policy-v4"})[0] == 200
        running["thread"].join(30)
        assert running["result"][1]["meta_info"]["finish_reason"]["type"] == "abort"
        # ... and false leaves it
        running = in_background(call, url, "/generate", {"text": "long", "sampling_params": _greedy(LONG)})
        wait_until(lambda: srv.server.core.num_running_reqs == 1)
        assert call(url, "/update_weight_version", {"new_version": "v5", "abort_all_requests": False})[0] == 200
        running["thread"].join(30)
        assert running["result"][1]["meta_info"]["finish_reason"]["type"] == "length"
        # disk updates take any string too; without one a non-integer version stays
        save_file(
            {n: p.detach().clone() for n, p in srv.server.core.model.named_parameters()},
            str(tmp_path / "model.safetensors"),
        )
        assert call(url, "/update_weights_from_disk", {"model_path": str(tmp_path), "weight_version": "step-7"})[1][
            "success"
        ]
        assert call(url, "/get_weight_version", method="GET")[1]["weight_version"] == "step-7"
        assert call(url, "/update_weights_from_disk", {"model_path": str(tmp_path)})[1]["success"]
        assert call(url, "/get_weight_version", method="GET")[1]["weight_version"] == "step-7"
    finally:
        srv.stop()


# --- item 18: endpoints ------------------------------------------------------------------------------


def test_tokenize_detokenize_load_and_model_card(server) -> None:
    url = server.url
    for path in ("/tokenize", "/v1/tokenize"):
        assert call(url, path, {"prompt": "hi"})[1] == {"tokens": [104, 105], "count": 2, "max_model_len": CONTEXT}
    assert call(url, "/tokenize", {"prompt": ["a", "bc"]})[1]["count"] == [1, 2]
    chat = call(url, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})[1]
    assert chat["tokens"][0] == 259 and chat["count"] == len(chat["tokens"])  # <|im_start|> opens the ChatML prompt
    assert call(url, "/tokenize", {"prompt": "a", "messages": []})[0] == 400
    for path in ("/detokenize", "/v1/detokenize"):
        assert call(url, path, {"tokens": [104, 105]})[1] == {"text": "hi"}
    assert call(url, "/detokenize", {"tokens": [[104], [105, 105]]})[1] == {"text": ["h", "ii"]}
    status, err = call(url, "/detokenize", {"tokens": [99999]})
    assert status == 400 and err["error"]["message"].startswith("tokens")

    running = in_background(call, url, "/generate", {"text": "load", "sampling_params": _greedy(LONG)})
    wait_until(lambda: server.server.core.num_running_reqs == 1)
    (load,) = call(url, "/get_load", method="GET")[1]
    assert load["dp_rank"] == 0 and load["num_reqs"] >= 1 and load["num_tokens"] >= 4
    assert set(load) == {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens", "num_pending_tokens", "ts_tic"}
    call(url, "/abort_request", {"abort_all": True})
    running["thread"].join(30)

    name = server.server.args.model_name
    card = call(url, f"/v1/models/{name}", method="GET")[1]
    assert card["id"] == name and card["object"] == "model" and card["max_model_len"] == CONTEXT
    status, err = call(url, "/v1/models/no-such-model", method="GET")
    assert status == 404 and err["error"]["code"] == "model_not_found" and err["error"]["param"] == "model"


def test_get_weights_by_name(server) -> None:
    core = server.server.core
    status, norm = call(server.url, "/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": 5})
    assert status == 200 and norm == core.model.model.norm.weight[:5].tolist()
    rows = call(server.url, "/get_weights_by_name", {"name": "lm_head.weight", "truncate_size": 2}, method="GET")[1]
    assert rows == core.model.lm_head.weight[:2].tolist()
    status, err = call(server.url, "/get_weights_by_name", {"name": "model.nope"})
    assert status == 400 and err["error"]["message"] == "Get parameter by name failed"


def test_release_and_resume_memory_occupation() -> None:
    srv = _serve()
    core, url = srv.server.core, srv.url
    try:
        original = {n: p.detach().clone() for n, p in core.model.named_parameters()}
        body = {"text": "memory", "sampling_params": _greedy(4), "return_logprob": True}
        before = call(url, "/generate", body)[1]
        busy = in_background(call, url, "/generate", {"text": "busy", "sampling_params": _greedy(LONG)})
        wait_until(lambda: core.num_running_reqs == 1)
        status, err = call(url, "/release_memory_occupation", {})
        assert status == 400 and "idle" in err["error"]["message"]  # SGLang: only when idle
        call(url, "/abort_request", {"abort_all": True})
        busy["thread"].join(30)
        assert call(url, "/release_memory_occupation", {"tags": ["bogus"]})[1]["error"]["message"].startswith("tags")

        assert call(url, "/release_memory_occupation", {}) == (200, None)
        weights = {p.untyped_storage().data_ptr(): p.untyped_storage() for p in core.model.parameters()}
        assert sum(s.nbytes() for s in weights.values()) == 0 and core.runner.cache.nbytes == 0  # really freed
        assert call(url, "/get_server_info", method="GET")[1]["internal_states"][0]["memory_released"] == [
            "weights",
            "kv_cache",
        ]
        status, err = call(url, "/generate", body)
        assert status == 503 and "released" in err["error"]["message"]  # refused at once, never held
        assert call(url, "/health_generate", method="GET")[0] == 200
        status, reply = call(
            url,
            "/update_weights_from_tensor",
            {"serialized_named_tensors": [encode_named_tensors(list(original.items()))]},
        )
        assert status == 400 and "released" in reply["message"]
        assert call(url, "/get_weights_by_name", {"name": "model.norm.weight"})[0] == 400

        assert call(url, "/resume_memory_occupation", {}) == (200, None)
        assert all(torch.all(p == 0) for p in core.model.parameters()) and core.weights_need_reload
        status, err = call(url, "/generate", body)
        assert status == 503 and "weights are zero" in err["error"]["message"]  # until a sync brings them back
        reply = call(
            url,
            "/update_weights_from_tensor",
            {"serialized_named_tensors": [encode_named_tensors(list(original.items()))], "weight_version": "restored"},
        )[1]
        assert reply["success"], reply
        after = call(url, "/generate", body)[1]
        assert after["output_ids"] == before["output_ids"] and after["meta_info"]["weight_version"] == "restored"
        assert after["meta_info"]["output_token_logprobs"] == before["meta_info"]["output_token_logprobs"]

        # the KV cache alone: requests continue on the same weights after the resume
        assert call(url, "/release_memory_occupation", {"tags": ["kv_cache"]})[0] == 200
        assert core.runner.cache.nbytes == 0 and not core.weights_released
        assert call(url, "/generate", body)[0] == 503
        assert call(url, "/resume_memory_occupation", {"tags": ["kv_cache"]})[0] == 200
        assert call(url, "/generate", body)[1]["output_ids"] == before["output_ids"]
    finally:
        srv.stop()


# --- item 19: smaller things ---------------------------------------------------------------------


def test_e2e_latency_only_in_the_final_chunk(server) -> None:
    events = stream(server.url, "/generate", {"text": "x", "sampling_params": _greedy(5), "stream": True})
    assert len(events) == 5 and all("e2e_latency" not in e["meta_info"] for e in events[:-1])
    assert events[-1]["meta_info"]["e2e_latency"] > 0


def test_deeply_nested_json_is_a_bad_request(server) -> None:
    deep = b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for path in ("/generate", "/v1/chat/completions", "/update_weights_from_disk", "/tokenize"):
        status, err = call(server.url, path, raw=deep)
        assert status == 400 and "body" in err["error"]["message"], (path, err)


def test_sglang_length_checks_and_messages(server) -> None:
    status, err = call(server.url, "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 10**9}})
    assert status == 400 and err["error"]["message"] == (
        "sampling_params.max_new_tokens: Requested token count exceeds the model's maximum context length of "
        f"{CONTEXT} tokens. You requested a total of {10**9 + 1} tokens: 1 tokens from the input messages and "
        f"{10**9} tokens for the completion. Please reduce the number of tokens in the input messages or the "
        "completion to fit within the limit."
    )
    ids = [1] * 1000
    status, err = call(server.url, "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 24}})
    assert status == 400 and "You requested a total of 1024 tokens" in err["error"]["message"]
    assert (
        call(server.url, "/generate", {"input_ids": ids, "sampling_params": _greedy(23)})[1]["meta_info"][
            "completion_tokens"
        ]
        == 23
    )
    status, err = call(server.url, "/generate", {"input_ids": [1] * CONTEXT})
    assert status == 400 and err["error"]["message"] == (
        f"input_ids: The input ({CONTEXT} tokens) is longer than the model's context length ({CONTEXT} tokens)."
    )
    out = call(server.url, "/generate", {"input_ids": ids, "sampling_params": {"temperature": 0, "ignore_eos": True}})[
        1
    ]
    assert (
        out["meta_info"]["completion_tokens"] == CONTEXT - 1000
    )  # no max_new_tokens: clamped, as SGLang's scheduler does
    status, err = call(server.url, "/v1/completions", {"prompt": "x", "max_tokens": 10**9})
    assert status == 400 and err["error"]["message"].startswith("max_tokens: Requested token count exceeds")
    status, err = call(
        server.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**9}
    )
    assert status == 400 and err["error"]["message"].startswith("max_tokens: max_completion_tokens is too large")


def test_the_openai_client_works_against_the_server(server) -> None:
    """The real `openai` package: model listing and retrieval, completions, chat, streaming, and
    the 401 it sees from a server with an API key."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    models = client.models.list().data
    assert models and client.models.retrieve(models[0].id).id == models[0].id
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    cmpl = client.completions.create(model=models[0].id, prompt="12+34=", max_tokens=4, temperature=0)
    assert cmpl.choices[0].finish_reason in ("length", "stop") and cmpl.usage.completion_tokens >= 1
    chat = client.chat.completions.create(
        model=models[0].id, max_tokens=4, temperature=0, messages=[{"role": "user", "content": "hi"}]
    )
    assert chat.choices[0].message.role == "assistant"
    chunks = list(
        client.chat.completions.create(
            model=models[0].id, max_tokens=4, temperature=0, stream=True, messages=[{"role": "user", "content": "hi"}]
        )
    )
    assert chunks and chunks[-1].choices[0].finish_reason in ("length", "stop")

    keyed = _serve(parse_server_args(["--api-key", "k1"]))
    try:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=keyed.url + "/v1", api_key="wrong", max_retries=0).models.list()
        assert openai.OpenAI(base_url=keyed.url + "/v1", api_key="k1", max_retries=0).models.list().data
    finally:
        keyed.stop()


# --- SGLang's own HTTP tests: sampling parameters, model and server info, launch flags, wording -------


def test_penalties_logit_bias_and_stop_regex_as_sglangs_tests_use_them(server) -> None:
    """SGLang's test_logit_bias, test_forbidden_token and test_finish_stop_regex_str, and its
    penalty ranges, against the server (they were refused with 400)."""
    url = server.url
    body = {
        "text": "The capital of France is",
        "return_logprob": True,
        "sampling_params": {"temperature": 1.0, "max_new_tokens": 4, "logit_bias": {"80": 100.0}},
    }
    status, out = call(url, "/generate", body)
    assert status == 200 and [t for _, t, _ in out["meta_info"]["output_token_logprobs"]] == [80] * 4, out
    greedy = call(url, "/generate", {"text": "rice", "sampling_params": _greedy(8)})[1]["output_ids"]
    banned = call(
        url, "/generate", {"text": "rice", "sampling_params": {**_greedy(8), "logit_bias": {str(greedy[0]): -100.0}}}
    )
    assert banned[0] == 200 and greedy[0] not in banned[1]["output_ids"]
    for sp in ({"frequency_penalty": 1.0}, {"presence_penalty": -1.0}, {"repetition_penalty": 1.3}):
        status, out = call(url, "/generate", {"text": "aaaa", "sampling_params": {**_greedy(16), **sp}})
        assert status == 200 and out["meta_info"]["completion_tokens"] == 16, out
    status, err = call(url, "/generate", {"text": "x", "sampling_params": {"frequency_penalty": 3}})
    assert status == 400 and err["error"]["message"] == (
        "sampling_params.frequency_penalty: frequency_penalty must be in [-2, 2], got 3.0."
    )
    status, err = call(
        url,
        "/generate",
        {"text": "x", "return_sampling_mask": True, "sampling_params": {"top_k": 4, "presence_penalty": 0.5}},
    )
    assert status == 400 and err["error"]["message"].startswith(
        "return_sampling_mask: cannot be combined with sampling_params.presence_penalty"
    )
    any_char = r"[\s\S]"
    for path, payload in [
        ("/v1/completions", {"prompt": "hello", "max_tokens": 50, "temperature": 0, "stop_regex": any_char}),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 50,
                "temperature": 0,
                "stop_regex": any_char,
                "frequency_penalty": 0.5,
                "logit_bias": {"80": 3.0},
            },
        ),
    ]:
        status, out = call(url, path, payload)
        assert status == 200, out
        assert out["choices"][0]["finish_reason"] == "stop" and out["choices"][0]["matched_stop"] == any_char, out


def _llama_dir(path: str) -> str:
    from transformers import LlamaForCausalLM

    from mcore_rl.hf import to_stock_hf_config
    from tests.helpers import tiny_model

    LlamaForCausalLM(
        to_stock_hf_config(tiny_model(use_qk_norm=False, max_position_embeddings=3000).config)
    ).save_pretrained(path)
    return path


def test_model_and_server_info_follow_sglang(tmp_path) -> None:
    """/model_info and /server_info (SGLang's current names) answer like /get_*; a stock Llama
    reports llama / LlamaForCausalLM and its own context length; /get_server_info has
    max_total_num_tokens; a successful /update_weights_from_disk moves model_path, a failed one not."""
    from mcore_rl.rollout.engine.core import EngineCore

    llama = _llama_dir(str(tmp_path / "llama"))
    srv = ServerThread(
        EngineServer(EngineDriver(EngineCore.from_model_path(llama)), ServerArgs(model_path=llama))
    ).__enter__()
    try:
        for path in ("/model_info", "/get_model_info"):
            status, info = call(srv.url, path, method="GET")
            assert status == 200 and info["model_path"] == llama, info
            assert (info["model_type"], info["architectures"]) == ("llama", ["LlamaForCausalLM"])
        for path in ("/server_info", "/get_server_info"):
            status, sinfo = call(srv.url, path, method="GET")
            assert status == 200 and sinfo["context_length"] == 3000 and sinfo["max_req_input_len"] == 2999
            assert isinstance(sinfo["max_total_num_tokens"], int) and sinfo["max_total_num_tokens"] >= 3000
        update = str(tmp_path / "update")
        os.makedirs(update)
        norm = srv.server.core.model.model.norm.weight
        save_file({"model.norm.weight": torch.full(tuple(norm.shape), 2.0)}, os.path.join(update, "model.safetensors"))
        status, reply = call(srv.url, "/update_weights_from_disk", {"model_path": str(tmp_path / "nowhere")})
        assert status == 400 and call(srv.url, "/model_info", method="GET")[1]["model_path"] == llama
        status, reply = call(srv.url, "/update_weights_from_disk", {"model_path": update})
        assert status == 200 and reply["success"], reply
        assert call(srv.url, "/model_info", method="GET")[1]["model_path"] == update
        sinfo = call(srv.url, "/server_info", method="GET")[1]
        assert sinfo["model_path"] == update and sinfo["served_model_name"] == llama  # the name stays the launch's
        assert sinfo["weight_dirs"][0] == os.path.abspath(llama)  # so do the directories weights may come from
        assert call(srv.url, "/v1/models", method="GET")[1]["data"][0]["id"] == llama
    finally:
        srv.stop()


def test_error_messages_use_sglangs_wording(server) -> None:
    """Clients match on SGLang's messages: a request id already in flight or repeated in a batch,
    an out-of-vocabulary token_ids_logprob id, a chat max_tokens above the context length."""
    url = server.url
    status, err = call(url, "/generate", {"text": ["a", "b"], "rid": ["x", "x"]})
    assert status == 400 and err["error"]["message"] == "rid: Duplicate request IDs detected within the request: ['x']"
    vocab = server.server.core.vocab_size
    status, err = call(url, "/generate", {"text": "a", "return_logprob": True, "token_ids_logprob": [1, vocab]})
    assert status == 400 and err["error"]["message"] == (
        f"token_ids_logprob contains out-of-vocabulary token id {vocab}; valid range is [0, {vocab})."
    )
    msgs = [{"role": "user", "content": "hello"}]
    for key in ("max_tokens", "max_completion_tokens"):
        status, err = call(url, "/v1/chat/completions", {"messages": msgs, key: CONTEXT + 176})
        assert status == 400 and err["error"]["message"] == (
            f"{key}: max_completion_tokens is too large: {CONTEXT + 176}. This model supports at most {CONTEXT} "
            "completion tokens."
        )
    status, err = call(url, "/v1/chat/completions", {"messages": msgs, "max_tokens": CONTEXT - 2})
    assert (
        status == 400 and "Requested token count exceeds the model's maximum context length" in err["error"]["message"]
    )


# SGLang's launch lines of its HTTP tests (test_srt_endpoint, test_skip_tokenizer_init, ...) and
# the knobs such launch lines carry: performance and deployment flags only.
SGLANG_TEST_FLAGS = [
    "--enable-custom-logit-processor",
    "--mem-fraction-static",
    "0.7",
    "--cuda-graph-max-bs",
    "8",
    "--cuda-graph-max-bs-decode",
    "8",
    "--stream-output",
    "--skip-tokenizer-init",
    "--max-total-tokens",
    "1000",
    "--context-length",
    "1000",
    "--disable-overlap-schedule",
    "--chunked-prefill-size=2048",
    "--page-size",
    "64",
    "--attention-backend",
    "fa3",
    "--enable-metrics",
    "--log-requests-target",
    "stdout",
    "/tmp/requests",
    "--tp",
    "1",
    "--enable-deterministic-inference",
    "--no-enable-tp-lm-head-all-to-all",
]


def test_every_sglang_launch_flag_is_classified() -> None:
    """Performance and deployment knobs start the server (recorded in /server_info); flags that
    change results are refused naming the flag; the tables do not overlap ours or each other."""
    from mcore_rl.rollout import sglang_flags
    from mcore_rl.rollout.launch_flags import LaunchFlagError, build_parser

    ours = set(build_parser()._option_string_actions)
    tables = [set(sglang_flags.IGNORED), set(sglang_flags.REFUSED), set(sglang_flags.ONLY)]
    assert all(not (a & b) for i, a in enumerate(tables) for b in tables[i + 1 :] + [ours])
    args = parse_server_args(SGLANG_TEST_FLAGS)
    assert args.incremental_streaming_output and args.context_length == 1000 and args.tp_size == 1
    assert args.ignored_flags == {
        "--enable-custom-logit-processor": [],
        "--cuda-graph-max-bs-decode": ["8"],
        "--skip-tokenizer-init": [],
        "--disable-overlap-schedule": [],
        "--page-size": ["64"],
        "--enable-metrics": [],
        "--log-requests-target": ["stdout", "/tmp/requests"],
        "--enable-deterministic-inference": [],
        "--no-enable-tp-lm-head-all-to-all": [],
    }
    srv = _serve(args)
    try:
        assert call(srv.url, "/server_info", method="GET")[1]["ignored_flags"]["--page-size"] == ["64"]
    finally:
        srv.stop()
    for argv, message in [
        (["--speculative-algorithm", "EAGLE"], "--speculative-algorithm: speculative decoding"),
        (["--enable-lora"], "--enable-lora: LoRA"),
        (["--chat-template", "x.jinja"], "--chat-template: "),
        (["--allow-auto-truncate"], "--allow-auto-truncate: "),
        (["--pp-size", "2"], "--pp-size 2: "),
        (["--sampling-defaults", "model"], "--sampling-defaults model: "),
        (["--ssl-certfile", "c.pem"], "--ssl-certfile: "),
        (["--not-an-sglang-flag"], "--not-an-sglang-flag: not a flag of SGLang's server"),
    ]:
        with pytest.raises(LaunchFlagError, match=f"^{message}"):
            parse_server_args(argv)
    assert parse_server_args(["--pp-size", "1", "--sampling-defaults=openai"]).ignored_flags == {
        "--pp-size": ["1"],
        "--sampling-defaults": ["openai"],
    }


def test_incremental_streaming_output_sends_only_what_is_new(server) -> None:
    """`--stream-output` / `--incremental-streaming-output`: the chunks of a streamed /generate,
    joined, are the whole reply (SGLang's disjoint segments); without it each chunk is cumulative."""
    body = {"text": "stream me", "sampling_params": {**_greedy(40), "stop": "zz"}, "stream": True}
    srv = _serve(parse_server_args(["--stream-output"]))
    try:
        whole = call(srv.url, "/generate", {**body, "stream": False})[1]
        chunks = stream(srv.url, "/generate", body)
        assert len(chunks) > 2
        assert sum((c["output_ids"] for c in chunks), []) == whole["output_ids"]
        assert "".join(c["text"] for c in chunks) == whole["text"]
    finally:
        srv.stop()
    cumulative = stream(server.url, "/generate", body)
    assert cumulative[-1]["output_ids"] == whole["output_ids"] and cumulative[-1]["text"] == whole["text"]
