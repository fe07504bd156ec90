"""A scripted judge for the judge-reward tests: a real HTTP server process that speaks SGLang's
`/generate` format (text or a batch of texts in; `text` + `meta_info.finish_reason` out) and
answers each prompt with the reply of the first rule whose substrings all occur in it.

    python tests/sglang_script_server.py SCRIPT.json [--upstream URL]

SCRIPT.json: `[[substring or [substrings], reply], ...]`. A reply is the judge's text, or
"@500" (HTTP 500), "@notjson" (a 200 that is not JSON), "@sleep:S:TEXT" (TEXT after S seconds),
"@length:TEXT" (TEXT, cut at max_new_tokens), "@forward" (the item sent on, with the request's
Authorization header, to the SGLang server at `--upstream`, and its reply returned as is). No rule:
HTTP 400. Prints "PORT n" once it listens on an ephemeral loopback port; appends every request
(body, Authorization header) to SCRIPT.log.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

import aiohttp
from aiohttp import web


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("script")
    ap.add_argument("--upstream", default=None)
    args = ap.parse_args()
    with open(args.script) as f:
        rules = [([key] if isinstance(key, str) else key, reply) for key, reply in json.load(f)]
    log = open(args.script + ".log", "a", buffering=1)

    def reply_for(text: str) -> str | None:
        for keys, reply in rules:
            if all(k in text for k in keys):
                return reply
        return None

    async def forward(item: str, sampling: dict, auth: str | None) -> dict:
        headers = {"Authorization": auth} if auth else {}
        async with aiohttp.ClientSession() as http:
            async with http.post(
                args.upstream + "/generate", json={"text": item, "sampling_params": sampling}, headers=headers
            ) as r:
                return await r.json()

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        auth = request.headers.get("Authorization")
        log.write(json.dumps({"body": body, "authorization": auth}) + "\n")
        texts = body["text"] if isinstance(body["text"], list) else [body["text"]]
        replies = [reply_for(t) for t in texts]
        if any(r is None for r in replies):
            return web.json_response({"error": "no scripted reply"}, status=400)
        if "@500" in replies:
            return web.json_response({"error": "scripted failure"}, status=500)
        if "@notjson" in replies:
            return web.Response(text="<html>bad gateway</html>", content_type="text/html")
        out = []
        for r in replies:
            if r == "@forward":
                out.append(await forward(texts[len(out)], body.get("sampling_params") or {}, auth))
                continue
            reason = "stop"
            if r.startswith("@sleep:"):
                _, seconds, r = r.split(":", 2)
                await asyncio.sleep(float(seconds))
            elif r.startswith("@length:"):
                reason, r = "length", r[len("@length:") :]
            out.append(
                {
                    "text": r,
                    "output_ids": list(r.encode()),
                    "meta_info": {
                        "id": str(len(out)),
                        "finish_reason": {"type": reason},
                        "prompt_tokens": 1,
                        "completion_tokens": len(r),
                    },
                }
            )
        return web.json_response(out if isinstance(body["text"], list) else out[0])

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="")

    async def serve() -> None:
        app = web.Application()
        app.router.add_post("/generate", generate)
        app.router.add_get("/health", health)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        print("PORT", site._server.sockets[0].getsockname()[1], flush=True)  # type: ignore[union-attr]  # the site has started, so its server is set
        await asyncio.Event().wait()

    asyncio.run(serve())


if __name__ == "__main__":
    sys.exit(main())
