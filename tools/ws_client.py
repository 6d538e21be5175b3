"""Stream one completion (or chat reply) over tokenmill's WebSocket endpoint to stdout.

    python tools/ws_client.py --url ws://127.0.0.1:8000/v1/stream --prompt "Once upon a time"
    python tools/ws_client.py --chat --prompt "What is the capital of France?" --api-key sk-...

Needs only the standard library and ``websockets``. The key goes in an
``Authorization: Bearer`` header (browsers, which cannot set headers, send the
subprotocol ``tokenmill.key.<KEY>`` instead). Ctrl-C sends a cancel and prints
how far the generation got.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

from websockets.asyncio.client import connect


async def stream(args: argparse.Namespace) -> int:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    req: dict = {"type": "chat" if args.chat else "completion", "id": "1", "max_tokens": args.max_tokens,
                 "temperature": args.temperature}
    if args.chat:
        req["messages"] = [{"role": "user", "content": args.prompt}]
    else:
        req["prompt"] = args.prompt
    async with connect(args.url, additional_headers=headers, max_size=None) as ws:
        await ws.send(json.dumps(req))
        try:
            async for raw in ws:
                msg = json.loads(raw)
                if msg["type"] == "delta":
                    sys.stdout.write(msg["text"])
                    sys.stdout.flush()
                elif msg["type"] == "done":
                    u = msg["usage"]
                    print(f"\n[{msg['finish_reason']}: {u['prompt_tokens']} prompt + {u['completion_tokens']} "
                          "completion tokens]", file=sys.stderr)
                    return 0
                elif msg["type"] == "error":
                    print(f"\nerror: {msg['error']['message']}", file=sys.stderr)
                    return 1
        except asyncio.CancelledError:
            await ws.send(json.dumps({"type": "cancel", "id": "1"}))
            raise
    print("\nconnection closed before the generation ended", file=sys.stderr)
    return 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="ws://127.0.0.1:8000/v1/stream")
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    ap.add_argument("--api-key", default=os.environ.get("TOKENMILL_API_KEY"),
                    help="API key (default: $TOKENMILL_API_KEY)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    args = ap.parse_args()
    try:
        return asyncio.run(stream(args))
    except KeyboardInterrupt:
        print("\n[cancelled]", file=sys.stderr)
        return 130
    except OSError as e:
        print(f"cannot connect to {args.url}: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - e.g. a refused handshake (401): one line, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
