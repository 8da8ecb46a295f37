"""Conversation and prompt/completion records: how one record becomes token ids with a trained flag per token.

Formats (`data.format`, or `format` of a `data.sources` entry; formats.py holds them all and detects them):

* `chat`: records with `messages` (a list of {role, content, ...}; optional `tools`), rendered with the chat
  template (chat_template.py), trained where `data.train_on` says.
* `prompt_completion`: records with a string `prompt` and `completion`: ids(prompt) + ids(completion) + EOS,
  trained on the completion and the EOS (`train_on: all` trains the prompt too). When both are lists of
  messages, the record is the conversation prompt + completion, rendered with the template like `chat`.

Preference pairs (`chosen` and `rejected`, preference.py) are encoded with `text_pair` and `Example` too. A
preference file stated as `chat` or `prompt_completion` is refused (`preference_error`).

An encoded record is an `Example`; `PackedConversations` (packing.py) packs whole examples into windows.

Images (Step-3.7 runs, `data.images`: an `ImageOptions`): a conversation's images are read and placed as their
placeholder runs (image_records.py); the Example carries them and where each run starts, and its image tokens are
never trained. Without `data.images`, a record with images stops the run (chat_messages.ImagesNotSupported).
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from step35.data.chat_messages import ChatTemplateError, ImagesNotSupported, check_messages, check_train_choice
from step35.data.image_records import ImageOptions, image_runs, record_images, untrain_image_tokens
from step35.data.images import ImageTokens
from step35.data.readers import BadRecord, MissingField, Record
from step35.data.tokenizer import PIECE_CHARS, TextTokenizer, cut_after

OVERLONG = ("truncate", "drop")
PLAIN_TEXT_SUFFIXES = (".txt", ".md")
PREFERENCE_FIELDS = ("chosen", "rejected")  # with an optional `prompt`: a preference pair (format preference)


@dataclass(frozen=True)
class Example:
    """One conversation or prompt/completion pair as tokens: `trained[i]` says whether token i is a target
    (unshifted: the label of token i - 1 is token i where `trained[i]`). `where` names the record."""

    ids: list[int]
    trained: list[bool]
    where: str
    total: int | None = None  # the record's tokens when more than `ids` holds (None: not all counted)
    complete: bool = True  # False: the record has more tokens than `ids` (encoded only as far as a window needs)
    images: tuple = ()  # images.ProcessedImage of the images whose placeholder runs lie within `ids`, in order
    image_starts: tuple[int, ...] = ()  # where each one's run starts in `ids`

    @property
    def size(self) -> str:
        """How many tokens the record has, as reports say it: "44", or "more than 1025" when not all were counted."""
        if self.complete:
            return str(len(self.ids))
        return str(self.total) if self.total is not None else f"more than {len(self.ids) - 1}"


def preference_error(where: Any, format: str = "chat") -> ValueError:
    """The error for a source of preference pairs read as another format (`where`: its file, record or hub name)."""
    return ValueError(
        f"{where}: the records are preference pairs (prompt/chosen/rejected), not {format} records: train on them"
        " with --model.objective dpo and data.format: preference (or auto, which detects them); for supervised"
        " fine-tuning give conversations ('messages') or prompt/completion pairs, or set the source's format: text"
        " and a text_field to train on one field as plain text"
    )


def first_ids(tokenizer: TextTokenizer, text: str, limit: int | None) -> tuple[list[int], bool]:
    """(the ids of `text`, whether they are all of them): tokenized in pieces as the text stream does
    (tokenizer.py), only until there are more than `limit` (all when `limit` is None)."""
    if limit is None:
        return tokenizer.encode(text), True
    ids: list[int] = []
    for start, piece in tokenizer.pieces(text):
        ids += piece
        if len(ids) > limit:
            return ids, cut_after(text, start, PIECE_CHARS) >= len(text)
    return ids, True


def text_pair(
    tokenizer: TextTokenizer, prompt: str, completion: str, limit: int | None, where: str, train_prompt: bool = False
) -> Example:
    """ids(prompt) + ids(completion) + EOS, trained on the completion and the EOS (and the prompt when
    `train_prompt`). With a `limit`, tokenized only until there are more than `limit` ids: an `Example` cut to
    `limit` with `complete` false (its `total` known when both texts were tokenized whole)."""
    prompt_ids, whole_prompt = first_ids(tokenizer, prompt, limit)
    room = None if limit is None else limit - len(prompt_ids)
    completion_ids, whole_completion = first_ids(tokenizer, completion, room)
    completion_ids.append(tokenizer.eos_token_id)
    trained = [train_prompt] * len(prompt_ids) + [True] * len(completion_ids)
    ids = prompt_ids + completion_ids
    if limit is None or len(ids) <= limit:
        return Example(ids, trained, where)
    total = len(ids) if whole_prompt and whole_completion else None
    return Example(ids[:limit], trained[:limit], where, total, complete=False)


class SftEncoder:
    """Turns a record of a `chat` or `prompt_completion` source into an `Example` (the `read` of
    `Source.documents`). Picklable: it travels to DataLoader workers with the stream.

    `template` is a chat_template.ChatTemplate (or None when the tokenizer folder has none: then a conversation
    record is an error naming `template_missing`, the message saying what to set).

    `window`: the packer's window. A record longer than it is encoded only as far as one token past it (an
    `Example` with `complete` false): the packer then truncates it to the window or drops it, and either needs
    no more, so a record's time and memory are bounded by the window, not by its length (a 20 MB assistant
    message took 5.1 GB and 31 s encoded whole; see `ChatTemplate.encode_prefix`).

    `images`: the run's `data.images` (image_records.ImageOptions); None: a record with images stops the run."""

    def __init__(
        self,
        format: str,
        tokenizer: TextTokenizer,
        template: Any = None,
        train_on: str = "assistant",
        template_missing: str = "",
        train_reasoning: bool = True,
        window: int | None = None,
        images: ImageOptions | None = None,
    ) -> None:
        if format not in ("chat", "prompt_completion"):
            raise ValueError(f"SftEncoder encodes chat or prompt_completion records, not {format!r}")
        check_train_choice(train_on, train_reasoning, "data")
        self.format = format
        self.tokenizer = tokenizer
        self.template = template
        self.train_on = train_on
        self.template_missing = template_missing
        self.train_reasoning = train_reasoning
        self.limit = None if window is None else window + 1  # tokens an example needs to show it is overlong
        self.images = images
        # the tokenizer's image token ids ({token: id}); a tokenizer without them is refused here, at setup
        self.image_ids = ImageTokens().ids(tokenizer.tokenizer) if images is not None else {}

    def __call__(self, record: Record) -> Example | None:
        value = record.value()
        if value is None:
            return None
        where = record.where()
        if "messages" not in value and "completion" not in value and set(PREFERENCE_FIELDS) <= set(value):
            raise preference_error(where, self.format)  # not a bad record: the source is of another format
        self._check_images_field(value, where)
        if self.format == "chat":
            if "messages" not in value:
                raise MissingField("messages", sorted(value), what="field")
            return self._conversation(value["messages"], value.get("tools"), where, self._images_of(record, value))
        if "prompt" not in value or "completion" not in value:
            raise MissingField("prompt" if "prompt" not in value else "completion", sorted(value), what="field")
        prompt, completion = value["prompt"], value["completion"]
        if isinstance(prompt, list) and isinstance(completion, list):
            return self._conversation(prompt + completion, value.get("tools"), where, self._images_of(record, value))
        if value.get("images"):
            raise BadRecord("'images' with a string prompt and completion: give the conversation as messages")
        for name, part in (("prompt", prompt), ("completion", completion)):
            if not isinstance(part, str):
                raise BadRecord(
                    f"{name!r} is {type(part).__name__}; prompt and completion are both strings or both message lists"
                )
        return text_pair(self.tokenizer, prompt, completion, self.limit, where, train_prompt=self.train_on == "all")

    def _check_images_field(self, value: dict, where: str) -> None:
        """Without data.images, an `images` field listing images stops the run, as image parts do."""
        if self.images is None and value.get("images"):
            raise ImagesNotSupported(
                f"{where}: the record lists 'images', and this run trains no vision side: set data.images for a"
                " Step-3.7 model (model.vision), or leave the records with images out of the data"
            )

    def _images_of(self, record: Record, value: dict) -> Any:
        """A function of the messages giving (messages with their images placed, the images), or None without
        data.images. Paths resolve relative to the folder of the record's file."""
        if self.images is None:
            return None
        base_dir = Path(getattr(getattr(record, "reader", None), "path", ".")).parent
        return lambda messages: record_images(value, messages, base_dir, self.images)

    def _conversation(self, messages: Any, tools: Any, where: str, place_images: Any = None) -> Example:
        """The record's conversation through the template. A bad conversation (no messages, an unknown role,
        no assistant turn, ...) and a template that fails to render it (the Jinja error) are bad records:
        skipped and counted, or refused when strict; the report names the record. Without data.images, images
        stop the run, naming the record too (chat_messages.ImagesNotSupported); with it (`place_images`), they
        are placed as their placeholder runs, which are found again in the tokens and not trained."""
        images: list = []
        if place_images is not None:
            messages, images = place_images(messages)
        try:
            if self.template is None:
                check_messages(messages)  # a bad record is still only skipped; a good one cannot be rendered
                raise ValueError(f"{where}: a conversation, and {self.template_missing}")
            self.template.check_tools(tools, where, source=self)  # warns once per source (one encoder each)
            ids, trained, total = self.template.encode_prefix(  # checks the messages first
                self.tokenizer, messages, self.limit, train_on=self.train_on, train_reasoning=self.train_reasoning,
                tools=tools,
            )  # fmt: skip
        except ChatTemplateError as error:
            raise BadRecord(str(error)) from None
        except ImagesNotSupported as error:  # checked without `where` (bad records get it from their report)
            raise ImagesNotSupported(f"{where}: {error}") from None
        ids, trained, complete = list(ids), [bool(t) for t in trained], total == len(ids)
        if place_images is None:
            return Example(ids, trained, where, total, complete=complete)
        starts = image_runs(ids, images, self.image_ids, complete)
        trained = untrain_image_tokens(ids, trained, self.image_ids)
        return Example(ids, trained, where, total, complete, tuple(images[: len(starts)]), starts)


def resolve_template(tokenizer_folder: Path, chat_template: str | None) -> tuple[Any, str]:
    """(the chat template conversations are rendered with, or None; the error to give when one is needed and
    there is none). `data.chat_template` wins; then the tokenizer folder's own (the built-in tokenizer's
    folder carries step35's default template: builtin.py)."""
    from step35.data.chat_template import ChatTemplate

    # A template that cannot be used at all (over the size cap, a chat_template field of the wrong kind) is a
    # refusal of the run's input, said in one line (ChatTemplateError is a refusal), not a failure with a traceback.
    try:
        if chat_template:
            path = Path(chat_template).expanduser()
            if not path.is_file():
                raise FileNotFoundError(f"data.chat_template {chat_template!r}: no such file (expected a .jinja file)")
            return ChatTemplate.from_file(path), ""
        template = ChatTemplate.from_folder(tokenizer_folder)
    except ChatTemplateError as error:
        if chat_template:
            raise ChatTemplateError(f"data.chat_template: {error}") from None
        raise
    missing = (
        f"the tokenizer folder {str(tokenizer_folder)!r} has no chat template (no chat_template.jinja, no"
        " chat_template in tokenizer_config.json): set data.chat_template to a .jinja file"
    )
    return template, missing
