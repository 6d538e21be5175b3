"""The Responses API's stored state over HTTP (``frontends.response_store`` keeps it): stored Responses
(``GET`` and ``DELETE /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``; a background
Response's cancel, and its events streamed again: ``frontends.background``) and OpenAI's
Conversations API (``/v1/conversations``: create, retrieve, update, delete; its ``items``: list, add,
retrieve, delete), each under the caller's API key. Lists page as OpenAI's do (``limit``, ``order``,
``after``). The Responses that read and grow this state: ``OpenAIApi.responses_job``.
"""

from __future__ import annotations

import re
import time
from urllib.parse import parse_qs, unquote

import orjson

from frontends import openai_params as op
from frontends.auth import Auth
from frontends.errors import ApiError, shown
from frontends.http import Request, Response, Router, StreamingResponse
from frontends.response_store import DuplicateItem, NotBackground, ResponseStore
from frontends.responses import (
    check_items,
    check_metadata,
    check_unique,
    duplicate_item,
    new_id,
    stored_items,
)

MAX_NEW_ITEMS = 20  # a conversation's items added in one call (OpenAI's limit)


def _json(obj: object) -> Response:
    return Response(200, orjson.dumps(obj))


def conversation_missing(conversation_id: str, param: str = "conversation_id") -> ApiError:
    return ApiError(404, f"Conversation with id '{shown(conversation_id)}' not found.", param=param)


def too_large(store: ResponseStore, param: str) -> ApiError:
    return ApiError(400, f"{param} takes more than the {store.max_one} bytes one call may add to a conversation "
                    "(a sixteenth of --responses-store-mib)", param=param)


def _paging(query: dict[str, str]) -> tuple[int, bool, str | None]:
    """A list's ``limit`` (1 to 100, 20 by default), whether its ``order`` is "desc" (the default, newest first; or
    "asc"), and the item it starts ``after``: OpenAI's paging."""
    order, limit = query.get("order", "desc"), query.get("limit", "20")
    if order not in ("asc", "desc"):
        raise ApiError(400, f"order must be 'asc' or 'desc', got {order!r}", param="order")
    if not (re.fullmatch(r"[0-9]{1,3}", limit) and 1 <= int(limit) <= 100):  # (not isdigit: "²" is a digit)
        raise ApiError(400, f"limit must be an integer in [1, 100], got {limit!r}", param="limit")
    return int(limit), order == "desc", query.get("after")


def _no_after(after: str) -> ApiError:
    return ApiError(400, f"after: no item with id '{shown(after)}'", param="after")


def _listed(items: list[dict], query: dict[str, str]) -> dict:
    """A page of ``items`` (all of them in hand) as ``_paging`` asks."""
    limit, descending, after = _paging(query)
    ordered = items[::-1] if descending else items
    if after is not None:
        at = next((k for k, item in enumerate(ordered) if item.get("id") == after), None)
        if at is None:
            raise _no_after(after)
        ordered = ordered[at + 1:]
    return _page(ordered[:limit], has_more=len(ordered) > limit)


def _page(items: list[dict], has_more: bool = False) -> dict:
    return {"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None, "has_more": has_more}


class StoredApi:
    def __init__(self, api) -> None:
        self.api = api  # the OpenAIApi: its store, its keys
        self.store = api.responses_store

    def routes(self, router: Router) -> None:
        auth = self.api.auth
        every = ("GET", "POST", "DELETE", "PUT", "PATCH")  # (the handlers say which a path under them takes: review AA)
        for method, path, handler in (
                *((m, "/v1/responses/{response_id}", self.response) for m in every),
                ("POST", "/v1/conversations", self.create),
                *((m, "/v1/conversations/{conversation_id}", self.conversation) for m in every)):
            router.add(method, path, auth.guard(handler, json_body=method == "POST" and handler != self.response),
                       refuses=auth.refuses)  # (a cancel has no body)
            router.add_preflight(path, auth.preflight)

    def _owner(self, req: Request) -> str:
        return self.api.auth.owner(Auth.given(req))

    @staticmethod
    def _path(req: Request, prefix: str) -> tuple[str, list[str]]:
        """The id after ``prefix`` and the parts after it, each percent-decoded."""
        raw = req.path.removeprefix(prefix).split("/")
        return unquote(raw[0]), [unquote(p) for p in raw[1:]]

    def _new_items(self, items) -> list[dict]:
        """Items given to a conversation, checked (at most ``MAX_NEW_ITEMS``, as ``input``'s are, and a sixteenth of
        the store in all), as the store keeps them."""
        items = stored_items(check_items(items, "items", MAX_NEW_ITEMS))
        check_unique(items, "items")
        if not self.store.fits(items):
            raise too_large(self.store, "items")
        return items

    def _none_kept(self, what: str) -> None:
        if self.store is None:
            raise ApiError(404, f"{what} (this server stores none: --responses-store-mib 0)")

    # ------------------------------------------------------------------ stored Responses

    async def response(self, req: Request) -> Response | StreamingResponse:
        """``GET /v1/responses/{id}`` (the client's ``responses.retrieve``; a background Response created streamed,
        with ``stream=true``: its events after ``starting_after``), ``DELETE`` (``responses.delete``),
        ``POST /v1/responses/{id}/cancel`` (``responses.cancel``) and ``GET /v1/responses/{id}/input_items``
        (``responses.input_items.list``)."""
        response_id, rest = self._path(req, "/v1/responses/")
        missing = ApiError(404, f"Response with id '{shown(response_id)}' not found.", param="response_id")
        allowed = {(): ("GET", "HEAD", "DELETE"), ("input_items",): ("GET", "HEAD"), ("cancel",): ("POST",)}.get(
            tuple(rest))
        if allowed is None:
            raise ApiError(404, f"No route for {req.method} {req.path}", type="not_found_error")
        if req.method not in allowed:  # (a HEAD is a GET's head: the router answers it so)
            raise ApiError(405, f"Method {req.method} not allowed here: {', '.join(allowed)}",
                           headers=[("allow", ", ".join(allowed))])
        self._none_kept(missing.message)
        owner, query, runs = self._owner(req), _query(req), self.api.background
        if req.method == "DELETE":
            if not await self.store.delete(response_id, owner):
                raise missing
            runs.stop(response_id)  # (a background one running here: aborted now; elsewhere, at its frontend's look)
            return _json({"id": response_id, "object": "response.deleted", "deleted": True})
        if rest == ["cancel"]:
            try:
                found = await self.store.cancel(response_id, owner)
            except NotBackground:
                raise ApiError(400, "Only a response created with background: true can be cancelled",
                               param="response_id") from None
            if found is None:
                raise missing
            if found["status"] == "cancelled":
                runs.stop(response_id)  # (running here: aborted now; elsewhere, at its frontend's next look)
            return _json(found)
        if rest:
            items = await self.store.input_items(response_id, owner)
            if items is None:
                raise missing
            return _json(_listed(items, query))
        stream = query.get("stream", "false").lower()
        if stream not in op.QUERY_TRUE + op.QUERY_FALSE:
            raise ApiError(400, f"stream must be true or false, got {shown(stream)!r}", param="stream")
        if stream in op.QUERY_TRUE:
            after = query.get("starting_after", "-1")
            if not re.fullmatch(r"-1|[0-9]{1,18}", after):
                raise ApiError(400, f"starting_after must be an event's sequence number, got {shown(after)!r}",
                               param="starting_after")
            found = await self.store.events(response_id, owner, int(after), limit=0)
            if found is None:
                raise missing
            if not found[2]:
                raise ApiError(400, "Only a background response created with stream: true is streamed again (and "
                               "only while its events are kept): retrieve it whole instead", param="stream")
            return runs.resume(response_id, owner, int(after))
        response = await self.store.get(response_id, owner)
        if response is None:
            raise missing
        return _json(response)

    # ------------------------------------------------------------------ conversations

    async def create(self, req: Request) -> Response:
        """``POST /v1/conversations``: ``items`` (at most 20) and ``metadata``, both optional."""
        data = op.parse_json(req.body)
        if self.store is None:
            raise ApiError(400, "Conversations are not kept: this server stores none (--responses-store-mib 0)")
        check_metadata(data.get("metadata"))
        items = self._new_items(data["items"] if data.get("items") is not None else [])
        conversation = {"id": new_id("conv"), "object": "conversation", "created_at": int(time.time()),
                        "metadata": data.get("metadata") or {}}
        await self.store.create_conversation(conversation, items, self._owner(req))
        return _json(conversation)

    async def conversation(self, req: Request) -> Response:
        """``/v1/conversations/{id}``: GET, POST (its ``metadata``), DELETE; ``.../items``: GET (a page), POST (more
        ``items``); ``.../items/{item_id}``: GET, DELETE (answered with the conversation)."""
        conversation_id, rest = self._path(req, "/v1/conversations/")
        missing = conversation_missing(conversation_id)
        method = "GET" if req.method == "HEAD" else req.method  # (the head of a GET's answer)
        routes = {(): ("GET", "POST", "DELETE"), ("items",): ("GET", "POST"), ("items", "*"): ("GET", "DELETE")}
        shape = tuple(rest[:1]) + (("*",) if len(rest) == 2 and rest[1] else ())
        if len(rest) > 2 or shape not in routes:
            raise ApiError(404, f"No route for {req.method} {req.path}", type="not_found_error")
        if method not in routes[shape]:
            allowed = ", ".join([*routes[shape], *(["HEAD"] if "GET" in routes[shape] else [])])
            raise ApiError(405, f"Method {req.method} not allowed here: {allowed}", headers=[("allow", allowed)])
        self._none_kept(missing.message)
        owner, store = self._owner(req), self.store
        if not rest:
            if method == "DELETE":
                if not await store.delete_conversation(conversation_id, owner):
                    raise missing
                return _json({"id": conversation_id, "object": "conversation.deleted", "deleted": True})
            if method == "POST":
                data = op.parse_json(req.body)
                if "metadata" not in data:
                    raise ApiError(400, "Missing required field: 'metadata'", param="metadata")
                check_metadata(data["metadata"])
                found = await store.update_conversation(conversation_id, owner, data["metadata"] or {})
            else:
                found = await store.conversation(conversation_id, owner)
            if found is None:
                raise missing
            return _json(found)
        if len(rest) == 1 and method == "POST":
            data = op.parse_json(req.body)
            if "items" not in data:
                raise ApiError(400, "Missing required field: 'items'", param="items")
            items = self._new_items(data["items"])
            try:
                if not await store.add_items(conversation_id, owner, items):
                    raise missing
            except DuplicateItem as e:
                raise duplicate_item(e.args[0], "items") from None
            return _json(_page(items))
        try:
            if len(rest) == 1:  # a page of its items
                limit, descending, after = _paging(_query(req))
                try:
                    found = await store.items_page(conversation_id, owner, limit, descending, after)
                except KeyError:
                    raise _no_after(after) from None
                if found is None:
                    raise missing
                return _json(_page(*found))
            found = await (store.delete_item if method == "DELETE" else store.item)(conversation_id, owner, rest[1])
        except KeyError:
            raise ApiError(404, f"Item with id '{shown(rest[1])}' not found.", param="item_id") from None
        if found is None:
            raise missing
        return _json(found)  # (the item; after a delete, the conversation, as OpenAI answers)


def _query(req: Request) -> dict[str, str]:
    return {k: v[-1] for k, v in parse_qs(req.query, keep_blank_values=True).items()}


