"""A chat template: loaded from a tokenizer's files, rendering conversations as transformers 5.x
`apply_chat_template` renders them, so that training sees the text inference engines produce.

The template renders in the bounded Jinja environment of chat_sandbox.py, on the messages as chat_messages.py
prepares them, with `tools` and `documents` passed as None when absent. The special tokens (`bos_token`,
`eos_token`) come from the tokenizer folder. The rendered text is tokenized WITHOUT adding special tokens: the
template writes them. Which tokens of a rendered conversation the loss trains (`ChatTemplate.encode`) is found
by chat_spans.py; step35's own template for tokenizers that ship none is DEFAULT_TEMPLATE.
"""

from __future__ import annotations

import functools
import json
import uuid
import warnings
import weakref
from pathlib import Path
from typing import Any

from step35.data.chat_messages import (
    ChatTemplateError,
    check_messages,
    check_train_choice,
    prepare_messages,
    where_prefix,
)
from step35.data.chat_sandbox import (
    RenderLimitHit,
    bounded_tree,
    input_size,
    is_generation_block,
    jinja_environment,
    render_limits,
)
from step35.data.chat_spans import Conversation, subtract_spans, token_mask

TEMPLATE_FILE = "chat_template.jinja"
# The largest template accepted, in characters. Real templates are under 100 KB; the cap keeps a template's own
# text (a huge comment, a literal) from being what bounds a rendering's memory (chat_sandbox.py's limits scale
# with the messages and tools rendered, not with the template).
TEMPLATE_MAX_CHARS = 1 << 20
# The tokenizer files a template and its special tokens are read from.
TEMPLATE_SOURCES = (TEMPLATE_FILE, "tokenizer_config.json", "special_tokens_map.json")

# Our template for tokenizers without one (the built-in tokenizer knows no chat tokens, so the headers are
# plain text it encodes byte by byte). Every assistant turn ends with the tokenizer's EOS, inside the
# generation block, so the model learns to stop; the generation prompt is the assistant header. The function
# schemas of `tools`, when given, come first: a `<|tools|>` block with one schema per line, as JSON. Tool calls
# are written in Step-3.5's step3p5 form, which the serving side's parser reads back (data/tool_calls.py):
# `<tool_call>\n<function=NAME>\n<parameter=ARG>\nVALUE\n</parameter>\n...</function>\n</tool_call>`, a string
# value as it is, any other as JSON.
DEFAULT_TEMPLATE = """\
{%- macro text(content) -%}
{%- if content is string -%}{{ content }}
{%- else -%}{%- for part in content or [] -%}{%- if part.type == 'text' -%}{{ part.text }}{%- endif -%}{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- if eos_token is not defined -%}{{ raise_exception('the default chat template needs eos_token') }}{%- endif -%}
{%- if tools -%}
{{- '<|tools|>\\n' -}}
{%- for tool in tools -%}{{- (tool | tojson) + '\\n' -}}{%- endfor -%}
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'assistant' -%}
{{- '<|assistant|>\\n' -}}
{%- generation -%}
{%- if message.reasoning_content -%}{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n' -}}{%- endif -%}
{{- text(message.content) -}}
{%- for call in message.tool_calls or [] -%}
{%- set function = call.function or call -%}
{{- '\\n' if (not loop.first or text(message.content)) else '' -}}
{{- '<tool_call>\\n<function=' + function.name + '>\\n' -}}{%- if function.arguments is string -%}{{- function.arguments + '\\n' -}}{%- endif -%}{%- for name, value in (function.arguments if function.arguments is mapping else {}).items() -%}{{- '<parameter=' + name + '>\\n' -}}{%- if value is string -%}{{- value -}}{%- else -%}{{- value | tojson -}}{%- endif -%}{{- '\\n</parameter>\\n' -}}{%- endfor -%}{{- '</function>\\n</tool_call>' -}}
{%- endfor -%}
{{- eos_token -}}
{%- endgeneration -%}
{{- '\\n' -}}
{%- else -%}
{{- '<|' + message.role + '|>\\n' + text(message.content) + '\\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"""


class DroppedToolsWarning(UserWarning):
    """Records carry `tools` that the chat template does not render (`ChatTemplate.check_tools`)."""


def _special_token(value: Any) -> str | None:
    """A special token as tokenizer files give it (text, or an AddedToken object with `content`), else None."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _check_template_size(source: str, named: str) -> None:
    """Refuse a template over TEMPLATE_MAX_CHARS; `named` says where it comes from (a file, a config field)."""
    if len(source) > TEMPLATE_MAX_CHARS:
        raise ChatTemplateError(
            f"chat template from {named}: {len(source)} characters, over step35's cap of {TEMPLATE_MAX_CHARS} for"
            " a chat template (real templates are under 100 KB); use the model's own template"
        )


def _read_json(data: bytes | None, file: Path) -> dict:
    """The JSON object in `data` (the contents of `file`, which errors name), {} when absent or not an object."""
    if data is None:
        return {}
    try:
        content = json.loads(data.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ChatTemplateError(f"{file}: not valid JSON ({e})") from None
    return content if isinstance(content, dict) else {}


# ------------------------------------------------------------------------------------------- the template


# What the renderer itself passes a template (as transformers' apply_chat_template does): never a user variable.
RENDER_ARGUMENTS = ("messages", "tools", "documents", "add_generation_prompt")


class ChatTemplate:
    """A Jinja chat template (`source`), where it came from (`origin`), the special tokens it is given, and
    `variables` given to every rendering (`with_variables`: e.g. a release's reasoning_effort)."""

    def __init__(
        self,
        source: str,
        origin: str,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        variables: dict | None = None,
    ):
        if not isinstance(source, str) or not source.strip():
            raise ChatTemplateError(f"chat template from {origin}: empty or not text")
        _check_template_size(source, origin)
        self.source = source
        self.origin = origin
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.variables = dict(variables or {})
        self._compiled = None
        self._marked: bool | None = None
        self._uses_tools: bool | None = None
        self._tools_warned: set = set()  # the sources told that this template drops their `tools`
        self._end_of_turn: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> end-of-turn id

    def __getstate__(self) -> dict:
        # A compiled Jinja template does not pickle; DataLoader workers compile their own on first use.
        return {
            "source": self.source,
            "origin": self.origin,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "variables": self.variables,
        }

    def __setstate__(self, state: dict) -> None:
        source, origin = state.pop("source"), state.pop("origin")
        self.__init__(source, origin, **state)

    def __repr__(self) -> str:
        return f"ChatTemplate(origin={self.origin!r}, {len(self.source)} characters)"

    @property
    def has_generation_marks(self) -> bool:
        """Whether the template marks its trained text with `{% generation %}` (checked by parsing, not by regex)."""
        if self._marked is None:
            from jinja2 import nodes

            self._template()  # a syntax error is reported as such
            ast = jinja_environment().parse(self.source)
            self._marked = any(is_generation_block(node) for node in ast.find_all(nodes.CallBlock))
        return self._marked

    @property
    def uses_tools(self) -> bool:
        """Whether the template reads the `tools` variable (the function schemas of agent data), by parsing."""
        if self._uses_tools is None:
            from jinja2 import nodes

            self._template()  # a syntax error is reported as such
            ast = jinja_environment().parse(self.source)
            self._uses_tools = any(n.name == "tools" and n.ctx == "load" for n in ast.find_all(nodes.Name))
        return self._uses_tools

    def check_tools(self, tools: Any, where: str = "", *, source: Any = None) -> None:
        """Warn, once per `source` (anything hashable: the SftEncoder of a data source passes itself; None: once
        per template), when records carry `tools` that this template leaves out of the text (it does not read
        `tools`), so the model is trained on tool calls without the schemas they answer to. `where` names the
        first such record."""
        if not tools or self.uses_tools or source in self._tools_warned:
            return
        self._tools_warned.add(source)
        warnings.warn(
            f"{where_prefix(where)}the records carry 'tools' (function schemas), but the chat template from"
            f" {self.origin} does not render them, so they are left out of the training text (said once per source);"
            " use a template that renders tools (step35's default does) or drop 'tools' from the data",
            DroppedToolsWarning,
            stacklevel=2,
        )

    # ------------------------------------------------------------------------------------ loading

    @classmethod
    def from_folder(cls, folder: str | Path) -> ChatTemplate | None:
        """The template of a tokenizer or model folder, or None when it has none (see `from_files`)."""
        folder = Path(folder).expanduser()
        return cls.from_files(
            {name: (folder / name).read_bytes() for name in TEMPLATE_SOURCES if (folder / name).is_file()}, folder
        )

    @classmethod
    def from_files(cls, files: dict[str, bytes], folder: str | Path) -> ChatTemplate | None:
        """The template held by a tokenizer's files (`files`: name -> contents, e.g. those a checkpoint
        records; `folder` names where they come from in errors), or None when they hold none.

        `chat_template.jinja` wins over `chat_template` in `tokenizer_config.json` (as in transformers); the
        latter may be a string or a list of {name, template}, of which "default" is taken. BOS and EOS tokens
        come from tokenizer_config.json, else special_tokens_map.json.
        """
        folder = Path(folder)
        config = _read_json(files.get("tokenizer_config.json"), folder / "tokenizer_config.json")
        special = _read_json(files.get("special_tokens_map.json"), folder / "special_tokens_map.json")
        tokens = {
            name: _special_token(config.get(name)) or _special_token(special.get(name))
            for name in ("bos_token", "eos_token")
        }
        if TEMPLATE_FILE in files:
            source = files[TEMPLATE_FILE].decode("utf-8")
            _check_template_size(source, str(folder / TEMPLATE_FILE))
            return cls(source, TEMPLATE_FILE, **tokens)
        template = config.get("chat_template")
        if template is None:
            return None
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            if "default" not in named:
                raise ChatTemplateError(
                    f"{folder / 'tokenizer_config.json'}: chat_template is a list without a 'default' entry"
                    f" (names: {sorted(map(str, named))})"
                )
            template = named["default"]
        if not isinstance(template, str):
            kind = type(template).__name__
            raise ChatTemplateError(f"{folder / 'tokenizer_config.json'}: chat_template is a {kind}, not text")
        _check_template_size(template, f"{folder / 'tokenizer_config.json'} (its chat_template field)")
        return cls(template, "tokenizer_config.json", **tokens)

    @classmethod
    def from_file(cls, path: str | Path) -> ChatTemplate:
        """A template file (a `.jinja` override); its special tokens come from a tokenizer folder via `with_tokens`."""
        path = Path(path).expanduser()
        if not path.is_file():
            raise ChatTemplateError(f"chat template file {str(path)!r} does not exist")
        return cls(path.read_text(encoding="utf-8"), str(path))

    @classmethod
    def default(cls) -> ChatTemplate:
        """step35's own small template for tokenizers that ship none (headers `<|user|>`, `<|assistant|>` in
        plain text; each assistant turn ends with `eos_token`; marked with `{% generation %}`)."""
        return cls(DEFAULT_TEMPLATE, "default")

    def with_tokens(self, *, bos_token: str | None = None, eos_token: str | None = None) -> ChatTemplate:
        """A copy whose missing bos/eos tokens are filled from these (e.g. a tokenizer folder's)."""
        return ChatTemplate(
            self.source,
            self.origin,
            bos_token=self.bos_token or bos_token,
            eos_token=self.eos_token or eos_token,
            variables=self.variables,
        )

    def with_variables(self, variables: dict, field: str) -> ChatTemplate:
        """A copy that renders every conversation with `variables` (the keyword arguments transformers'
        apply_chat_template passes on: a release's `reasoning_effort`, `enable_thinking`, ...), as the
        `field` of a config or command line (named in errors). Refused: a name that is not a Jinja variable
        name, one the renderer passes itself (RENDER_ARGUMENTS), and one this template never reads (a typo
        would otherwise render the template's default silently), listing those it reads."""
        from jinja2 import meta

        if not isinstance(variables, dict):
            raise ChatTemplateError(f"{field}: expected a mapping of template variables, got {variables!r}")
        self._template(field)  # a syntax error is reported as such
        env = jinja_environment()
        reads = meta.find_undeclared_variables(env.parse(self.source)) - set(env.globals)
        for name in variables:
            if not (isinstance(name, str) and name.isidentifier()):
                raise ChatTemplateError(f"{field}: {name!r} is not a template variable name")
            if name in RENDER_ARGUMENTS:
                raise ChatTemplateError(
                    f"{field}.{name}: set by step35 for every rendering (as by transformers), not a template option"
                )
            if name not in reads:
                options = sorted(reads - set(RENDER_ARGUMENTS) - {"bos_token", "eos_token"})
                raise ChatTemplateError(
                    f"{field}.{name}: the chat template from {self.origin} does not read a variable of that name"
                    f" (it reads: {', '.join(options) or 'none besides messages and tools'})"
                )
        return ChatTemplate(
            self.source,
            self.origin,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            variables={**self.variables, **variables},
        )

    def check_syntax(self) -> None:
        """Raise ChatTemplateError naming the template, the line and Jinja's message when the template does not
        parse (a run checks it at setup: every record would otherwise fail to render, each a bad record)."""
        self._template()

    def save(self, folder: str | Path) -> Path:
        """Write the template as `folder/chat_template.jinja` (where transformers and `from_folder` look first)."""
        path = Path(folder) / TEMPLATE_FILE
        path.write_text(self.source, encoding="utf-8")
        return path

    # ---------------------------------------------------------------------------------- rendering

    def _template(self, where: str = ""):
        if self._compiled is None:
            import jinja2

            try:
                env = jinja_environment()
                tree = bounded_tree(env.parse(self.source))
                tree.set_environment(env)
                self._compiled = env.from_string(tree)
            except jinja2.TemplateSyntaxError as e:
                raise ChatTemplateError(
                    f"{where_prefix(where)}chat template from {self.origin} does not parse (line {e.lineno}):"
                    f" {e.message}"
                ) from None
        return self._compiled

    def _render(self, messages: list, *, where: str, add_generation_prompt: bool, tools, extra: dict) -> str:
        # A special token the tokenizer lacks stays undefined, as transformers leaves it out of its arguments.
        tokens = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        kwargs = {**{key: value for key, value in tokens.items() if value is not None}, **self.variables, **extra}
        try:
            compiled, prepared = self._template(where), prepare_messages(messages)
            # The limits of this rendering scale with what it renders (RENDER_TEXT_PER_INPUT), not with the
            # template's own size, which would let a huge comment buy a huge budget (TEMPLATE_MAX_CHARS).
            with render_limits(input_size([prepared, tools, kwargs])):
                return compiled.render(
                    messages=prepared,
                    tools=tools,
                    documents=None,
                    add_generation_prompt=add_generation_prompt,
                    **kwargs,
                )
        except RenderLimitHit as e:
            raise ChatTemplateError(f"{where_prefix(where)}chat template from {self.origin} refused: {e}") from None
        except ChatTemplateError:
            raise
        except Exception as e:  # a Jinja TemplateError, or a Python error a template expression raised
            raise ChatTemplateError(
                f"{where_prefix(where)}chat template from {self.origin} failed to render: {type(e).__name__}: {e}"
            ) from None

    def render(
        self,
        messages: list,
        *,
        add_generation_prompt: bool = False,
        tools: list | None = None,
        where: str = "",
        **extra,
    ) -> str:
        """The conversation as text, as transformers' apply_chat_template(tokenize=False) renders it.
        `extra` reaches the template as variables (e.g. enable_thinking, bos_token, eos_token)."""
        return self._render(
            messages, where=where, add_generation_prompt=add_generation_prompt, tools=tools, extra=extra
        )

    def prompt_ids(
        self, tokenizer, messages: list, *, tools: list | None = None, where: str = "", **extra
    ) -> list[int]:
        """The token ids inference starts from: the conversation so far plus the generation prompt."""
        check_messages(messages, where, require_assistant=False)
        extra = self._tokens(tokenizer, extra)
        text = self.render(messages, add_generation_prompt=True, tools=tools, where=where, **extra)
        return tokenizer.tokenizer.encode(text, add_special_tokens=False).ids

    def _tokens(self, tokenizer, extra: dict) -> dict:
        """`extra`, with eos_token filled from the tokenizer's EOS id when neither the template nor the caller
        gave one."""
        if self.eos_token is None and "eos_token" not in extra and getattr(tokenizer, "eos_token_id", None) is not None:
            return {**extra, "eos_token": tokenizer.tokenizer.id_to_token(tokenizer.eos_token_id)}
        return extra

    # ------------------------------------------------------------------------------------ masking

    def encode(
        self,
        tokenizer,
        messages: list,
        *,
        train_on: str = "assistant",
        train_reasoning: bool = True,
        tools: list | None = None,
        where: str = "",
        **extra,
    ) -> tuple[list[int], list[bool]]:
        """(token ids of the whole rendered conversation, per token whether its loss is trained).

        `train_on`: "assistant" every assistant turn, "last_assistant" the final one, "all" every token. A
        trained turn covers what the model emits after the generation prompt: the reasoning as the template
        renders it, the content, tool calls and the end-of-turn token. With `train_reasoning` false, the
        reasoning text of the trained assistant turns (of every assistant turn for "all") is left out, as the
        template renders it (a field or a `<think>` block inline in the content); the `<think>`/`</think>`
        wrappers around it stay trained, so the model still learns to open and close the block. A token holding
        both reasoning and other trained text stays trained. The caller shifts the mask to labels.
        """
        ids, mask, _ = self.encode_prefix(
            tokenizer, messages, None, train_on=train_on, train_reasoning=train_reasoning, tools=tools, where=where,
            **extra,
        )  # fmt: skip
        return ids, mask

    def encode_prefix(
        self,
        tokenizer,
        messages: list,
        max_tokens: int | None,
        *,
        train_on: str = "assistant",
        train_reasoning: bool = True,
        tools: list | None = None,
        where: str = "",
        trained_turns: list[int] | None = None,
        **extra,
    ) -> tuple[list[int], list[bool], int | None]:
        """As `encode`, for the first `max_tokens` tokens only (all when None): (their ids, their mask, how many
        tokens the whole conversation has, or None when it has more than `max_tokens` and was not tokenized
        whole to count them). A packer that keeps a window of a longer conversation needs no more,
        and this keeps a conversation's cost bounded by the window, not by its length:

        - Tokens: a rendering over `2 * PIECE_CHARS` characters is tokenized in pieces cut as the text stream
          cuts documents (tokenizer.py, with the same caveats on where piece tokens can differ), only until
          `max_tokens` tokens are there. (A 20 MB assistant message took 5.1 GB and 31 s tokenized whole.)
        - Spans: only the turns that can reach the kept tokens are located, on the shortest cut of the
          conversation (its first messages) whose rendering equals the whole rendering over the kept tokens'
          characters (`Conversation.cuts`), so locating costs renderings of the cut, not of the whole (which made
          masking quadratic in turns without `{% generation %}` marks). Turns are located in order and each
          span starts past the end of the one before, so once a turn is known to start past the kept characters
          every later one does too: the mask of the kept tokens is the one the whole conversation gives. A turn
          past the kept tokens is not located, so a fault in it (one that would make `encode` raise) is not seen.

        `trained_turns`: the indices of the assistant messages to train, instead of the ones `train_on` picks
        (a preference pair trains only its reply's turns, preference.py); not with `train_on` "all".
        """
        check_train_choice(train_on, train_reasoning, where)
        check_messages(messages, where)
        render = functools.partial(self._render, tools=tools, extra=self._tokens(tokenizer, extra))
        conversation = Conversation(render, self.origin, messages, where)
        ids, offsets, total = _tokenize_prefix(tokenizer, conversation.text, max_tokens)
        limit = None if total == len(ids) else (offsets[-1][1] if offsets else 0)  # the characters of the kept tokens
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if trained_turns is not None:
            if train_on == "all" or not set(trained_turns) <= set(turns):
                raise ChatTemplateError(
                    f"{where_prefix(where)}trained_turns {trained_turns} must be assistant messages (at {turns}), and"
                    f" train_on not 'all' (got {train_on!r})"
                )
            turns, train_on = sorted(trained_turns), "assistant"
        if train_on == "all":
            if train_reasoning:
                return ids, [True] * len(ids), total
            spans = [(0, len(conversation.text))]
        else:
            if train_on == "last_assistant":
                turns = turns[-1:]
            if self.has_generation_marks:
                spans = conversation.marked_spans(turns)
            else:
                end_of_turn = functools.partial(self.end_of_turn_id, tokenizer, tools=tools, where=where, **extra)
                spans = conversation.in_window(
                    limit, lambda part: part.located_spans(turns, ids, offsets, end_of_turn, limit)
                )  # fmt: skip
        if not train_reasoning:
            reasoning = conversation.in_window(limit, lambda part: part.reasoning_spans(turns, limit))
            spans = subtract_spans(spans, reasoning)
        return ids, token_mask(offsets, spans), total

    def end_of_turn_id(self, tokenizer, *, tools: list | None = None, where: str = "", **extra) -> int:
        """The token the template ends an assistant reply with (where `generate --chat` stops): the first special
        token (added as special, or the tokenizer's EOS) after the reply in a probe conversation of one user
        and one assistant message. Cached per tokenizer; a ChatTemplateError when no special token follows."""
        if tokenizer not in self._end_of_turn:
            sentinel = "step35probe" + uuid.uuid4().hex
            probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": sentinel}]
            text = self._render(
                probe, where=f"{where_prefix(where)}probe conversation", add_generation_prompt=False, tools=tools,
                extra=self._tokens(tokenizer, extra),
            )  # fmt: skip
            encoding = tokenizer.tokenizer.encode(text, add_special_tokens=False)
            special = _special_ids(tokenizer)
            after = text.find(sentinel) + len(sentinel) if sentinel in text else None
            found = (
                None
                if after is None
                else next((t for (s, _), t in zip(encoding.offsets, encoding.ids) if s >= after and t in special), None)
            )
            if found is None:
                raise ChatTemplateError(
                    f"{where_prefix(where)}chat template from {self.origin}: no special token follows an assistant"
                    " reply, so the end of a turn cannot be told; add {% generation %} marks to the template"
                )
            self._end_of_turn[tokenizer] = found
        return self._end_of_turn[tokenizer]


def _tokenize_prefix(
    tokenizer, text: str, max_tokens: int | None
) -> tuple[list[int], list[tuple[int, int]], int | None]:
    """(ids, character offsets, how many tokens `text` has: None when not all were tokenized) of the first
    `max_tokens` tokens of `text` (all when None). A text over `2 * PIECE_CHARS` characters is tokenized in
    pieces (`cut_after`), only as far as needed, so the tokenizer's memory is a piece's (tokenizer.py), however
    long the text; a few tokens past `max_tokens` are tokenized too, so that a hard cut's tokens are never kept."""
    from step35.data.tokenizer import PIECE_CHARS, cut_after

    if max_tokens is None or len(text) <= 2 * PIECE_CHARS:
        encoding = tokenizer.tokenizer.encode(text, add_special_tokens=False)
        ids, offsets = encoding.ids, encoding.offsets  # each read of these builds a fresh Python list
        start = len(text)
    else:
        ids, offsets, start = [], [], 0
        tokenizer.check_piecewise_exact()  # warns once if this tokenizer gives other tokens in pieces
        while start < len(text) and len(ids) <= max_tokens + _PIECE_MARGIN:
            end = cut_after(text, start, PIECE_CHARS)
            encoding = tokenizer.tokenizer.encode(text[start:end], add_special_tokens=False)
            ids += encoding.ids
            offsets += [(a + start, b + start) for a, b in encoding.offsets]
            start = end
    total = len(ids) if start >= len(text) else None
    if max_tokens is None or len(ids) <= max_tokens:
        return ids, offsets, total
    return ids[:max_tokens], offsets[:max_tokens], total


_PIECE_MARGIN = 64  # tokens tokenized past the ones kept, so that a piece's last (maybe cut) tokens are not kept


def _special_ids(tokenizer) -> set[int]:
    """The ids a turn can end with: the tokenizer's tokens added as special, and its EOS."""
    ids = {i for i, added in tokenizer.tokenizer.get_added_tokens_decoder().items() if added.special}
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
