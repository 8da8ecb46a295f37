"""What a conversation is, checked before it is rendered, and prepared as transformers prepares it.

A conversation (`messages`) is a list of {role, content} objects (roles in ROLES); `check_messages` refuses
anything else with a ChatTemplateError naming the record, and `check_train_choice` the `train_on` and
`train_reasoning` options. Before rendering, `prepare_messages` does to the messages what transformers 5.x
`apply_chat_template` does: keys whose value is None dropped, the reasoning of a message (given as
`reasoning_content`, `thinking` or `reasoning`, first found wins) copied to `reasoning_content`, and to
`thinking` unless the message has one; and, unlike transformers, tool calls' `arguments` given as a JSON string
parsed first (`_parsed_arguments`).

Image (and video) content parts are no bad record to skip but `ImagesNotSupported`, which stops the run, in a run
without `data.images` (its language model alone trains; a Step-3.7-Flash folder's vision encoder and projector are
carried, not trained). With `data.images`, image parts are replaced by their placeholder runs before these checks
(image_records.py); a video part still stops the run.
"""

from __future__ import annotations

import json
from typing import Any

from step35.data.readers import too_deep

TRAIN_ON = ("assistant", "last_assistant", "all")
ROLES = ("system", "user", "assistant", "tool")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# The content part types of images and videos: transformers' (`image`, `video`), OpenAI chat's (`image_url`,
# `video_url`) and OpenAI Responses' (`input_image`).
IMAGE_PARTS = ("image", "image_url", "input_image", "video", "video_url")


class ChatTemplateError(ValueError):
    """A conversation or chat template that cannot be rendered or masked; the message names where."""

    step35_refusal = True  # at fit start: said in one line, without a traceback (step35.faults)


class ImagesNotSupported(NotImplementedError):
    """A conversation with image or video content. Not a bad record (a ValueError, skipped and counted): data made
    for a vision-language model trained on its text alone would be another run than the one asked for, so the
    run stops, naming the record. Not a ValueError either, so that no reader takes it for a bad record or an
    empty holdout."""


def where_prefix(where: str) -> str:
    """`where` (a record's file and line, `data`, ...) as the start of an error message; "" when not given."""
    return f"{where}: " if where else ""


def check_train_choice(train_on: Any, train_reasoning: Any, where: str = "") -> None:
    """The one rule for `train_on` and `train_reasoning`, wherever they are given (the DataModule's options,
    an SftEncoder, ChatTemplate.encode); `where` names the place (`data`, a record's file and line)."""
    if train_on not in TRAIN_ON:
        raise ChatTemplateError(f"{where_prefix(where)}train_on={train_on!r}; expected one of {', '.join(TRAIN_ON)}")
    if not isinstance(train_reasoning, bool):
        raise ChatTemplateError(f"{where_prefix(where)}train_reasoning={train_reasoning!r}; expected true or false")


def check_messages(messages: Any, where: str = "", *, require_assistant: bool = True) -> None:
    """Raise ChatTemplateError naming `where` (e.g. "data.jsonl:3") unless `messages` is a non-empty list of
    {role, content} objects with known roles and, when `require_assistant`, at least one assistant turn.
    Content is text or a non-empty list of text parts (`_check_parts`); an assistant turn may leave it out (or
    give None or []) when it carries `tool_calls`, which must be a list of objects; reasoning, under any of its
    names, must be text."""
    at = where_prefix(where)
    if not isinstance(messages, list):
        kind = type(messages).__name__
        raise ChatTemplateError(f"{at}'messages' must be a list of {{role, content}} objects, got {kind}")
    if not messages:
        raise ChatTemplateError(f"{at}empty conversation ('messages' is [])")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            kind = type(message).__name__
            raise ChatTemplateError(f"{at}message {i} is a {kind}, not an object with role and content")
        if "role" not in message:
            raise ChatTemplateError(f"{at}message {i} has no 'role' (keys: {sorted(message)})")
        role = message["role"]
        if role not in ROLES:
            raise ChatTemplateError(f"{at}message {i} has unknown role {role!r} (expected one of {', '.join(ROLES)})")
        content = message.get("content")
        if content is None and not (role == "assistant" and message.get("tool_calls")):
            raise ChatTemplateError(f"{at}message {i} ({role}) has no 'content'")
        if content is not None and not isinstance(content, (str, list)):
            raise ChatTemplateError(
                f"{at}message {i} ({role}) has 'content' of type {type(content).__name__};"
                " expected text or a list of parts"
            )
        if isinstance(content, list):
            calling = role == "assistant" and bool(message.get("tool_calls"))
            _check_parts(content, f"{at}message {i} ({role})", allow_empty=calling)
        calls = message.get("tool_calls")
        if calls is not None and not (isinstance(calls, list) and all(isinstance(c, dict) for c in calls)):
            raise ChatTemplateError(f"{at}message {i} ({role}) has 'tool_calls' that are not a list of objects")
        for key in REASONING_FIELDS:
            if message.get(key) is not None and not isinstance(message[key], str):
                kind = type(message[key]).__name__
                raise ChatTemplateError(f"{at}message {i} ({role}) has '{key}' of type {kind}; expected text")
    if require_assistant and not any(m["role"] == "assistant" for m in messages):
        roles = [m["role"] for m in messages]
        raise ChatTemplateError(f"{at}no assistant turn, so nothing to train on (roles: {roles})")


def _check_parts(parts: list, at: str, *, allow_empty: bool) -> None:
    """Content given as parts must be {type: "text", text: ...} objects: a text model cannot train on an image
    or audio part, and templates render such parts (and an empty list) as no text at all, silently. An image or
    video part stops the run (`ImagesNotSupported`); any other makes the record a bad record, counted and
    skipped (or refused under data.strict)."""
    if not parts and not allow_empty:
        raise ChatTemplateError(f"{at} has 'content' [] (no parts): give its text, or leave the message out")
    for k, part in enumerate(parts):
        if not isinstance(part, dict):
            raise ChatTemplateError(f"{at}: content part {k} is a {type(part).__name__}, not a {{type, text}} object")
        kind = part.get("type")
        if kind in IMAGE_PARTS:
            raise ImagesNotSupported(
                f"{at}: content part {k} is an image ({kind!r}), and this run reads no images (no data.images:"
                " its language model alone trains; a Step-3.7 folder's vision encoder and projector are carried"
                " unchanged): to train on images, set data.images and model.vision with a Step-3.7 model"
                " (docs/vision.md; videos are not supported), or leave the records with images out of the data"
            )
        if kind != "text":
            raise ChatTemplateError(
                f"{at}: content part {k} has type {kind!r}; only text parts can be trained on (drop or describe"
                " non-text parts such as audio in text)"
            )
        if not isinstance(part.get("text"), str):
            raise ChatTemplateError(f"{at}: content part {k} (text) has no 'text' string")


def prepare_messages(messages: list) -> list[dict]:
    """What transformers does to messages before rendering: drop None values, alias the reasoning names; and
    tool calls' `arguments` given as a JSON string (OpenAI's format) parsed (`_parsed_arguments`)."""
    prepared = []
    for message in messages:
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[key] for key in REASONING_FIELDS if key in message), None)
        if reasoning is not None:
            # `thinking` only where the message lacks it (gpt-oss templates read it), `reasoning_content` always
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        if isinstance(message.get("tool_calls"), list):
            message["tool_calls"] = [_parsed_arguments(call) for call in message["tool_calls"]]
        prepared.append(message)
    return prepared


def _parsed_arguments(call: Any) -> Any:
    """A tool call whose `arguments` (under `function`, or at its top level) is a string holding a JSON object,
    with that object instead: templates write arguments with `tojson`, which would encode the string a second
    time (`"{\\"city\\": ..."`) and render the same call differently from one whose arguments are an object. A
    string that does not hold a JSON object stays as it is."""
    if not isinstance(call, dict):
        return call
    function = call.get("function")
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        parsed = _json_object(function["arguments"])
        if parsed is not None:
            call = {**call, "function": {**function, "arguments": parsed}}
    if isinstance(call.get("arguments"), str):
        parsed = _json_object(call["arguments"])
        if parsed is not None:
            call = {**call, "arguments": parsed}
    return call


def _json_object(text: str) -> dict | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    except RecursionError:  # no call's arguments nest this deep: a bad record, said as such
        raise ChatTemplateError(str(too_deep("a tool call's 'arguments' JSON text"))) from None
    return value if isinstance(value, dict) else None
