"""Packing one source's documents into fixed windows of tokens, resumable at every window: text documents run
across windows (`PackedSource`); conversations and prompt/completion pairs are packed whole, with labels and
positions (`PackedConversations`); preference pairs are packed whole, their two sequences side by side, with
the `preference` ids of the DPO batch contract (`PackedPairs`)."""

import warnings
from collections.abc import Iterator
from typing import Any

import torch

from step35.data.bad_records import BadRecords, OverlongRecords
from step35.data.image_records import fits_window, window_image_tensors
from step35.data.readers import BadRecord
from step35.data.resume import DataChangedError, DataChangedWarning
from step35.data.sft import Example
from step35.data.sources import Cursor
from step35.data.tokenizer import TextTokenizer

IGNORE_INDEX = -100  # a label that is no target (torch.nn.functional.cross_entropy's default ignore_index)


def fresh_packing_state(skipped: int = 0, truncated: int = 0, dropped: int = 0) -> dict[str, Any]:
    """The start of a source's stream. `parts` and `stamp` say which data the cursor points into (the source's
    digest, the stamp of the cursor's file); they are set with the first window and checked on resume.
    `truncated` and `dropped` count overlong conversations (absent from states saved before they existed)."""
    return {"cursor": Cursor().to_list(), "piece": 0, "skip": 0, "done": False, "skipped": skipped,
            "parts": None, "stamp": None, "truncated": truncated, "dropped": dropped}  # fmt: skip


class PackedSource:
    """Windows of `window` tokens from one shard of one source: each document's ids then EOS, concatenated.

    Windows do not overlap and documents run across window borders. A window is complete when it is handed
    out, so no tokens are ever carried in the state: after each window, `state` holds the cursor of the
    document the next window starts in, the character where its piece starts (`piece`: a long document is
    tokenized in pieces, see tokenizer.py) and how many of that piece's tokens are used up (`skip`). A resume
    re-reads that one document and re-tokenizes from that piece on, which keeps the state a few integers and
    the memory a piece's worth even for a book-sized document. (A state without `piece`, saved before pieces
    existed, reads as piece 0 with `skip` counted from the document's start: the same position.)
    A finite stream (`endless=False`) drops its last, partial window and sets `done`.
    """

    def __init__(
        self,
        source: Any,
        tokenizer: TextTokenizer,
        window: int,
        shard: int,
        num_shards: int,
        endless: bool,
        strict: bool,
        state: dict[str, Any],
    ) -> None:
        self.source = source
        self.tokenizer = tokenizer
        self.window = window
        self.shard = shard
        self.num_shards = num_shards
        self.endless = endless
        self.state = state  # updated in place before every window leaves, read by the stream's state_dict()
        self.strict = strict
        self.bad = BadRecords(source.name, strict, count=state["skipped"])
        self._digest = source.digest()
        self._stamped: tuple[Any, Any] = (None, None)  # ((epoch, file), stamp) of the last cursor's file

    def check_data(self) -> None:
        """Restart this source's stream, with a warning (or refuse, when strict), if the saved position belongs
        to other data: the source's file list changed, or the file the cursor points into (a line deleted
        before the cursor would otherwise send the resume into the middle of another document)."""
        state = self.state
        if state.get("parts") is None:  # a fresh stream, or a state saved before data checks existed
            return
        cursor = Cursor(*state["cursor"])
        then, now = state.get("stamp"), None
        if state["parts"] != self.source.digest():
            problem = f"its list of files changed ({len(self.source.parts)} files now)"
        elif then != (now := self.source.stamp(cursor)):
            sizes = then and now and then[0] != now[0]
            how = f"{then[0]} bytes then, {now[0]} now" if sizes else "its content, at the same size"
            problem = f"{self.source.part_name(cursor)} changed ({how})"
        else:
            return
        if self.strict:
            raise DataChangedError(
                f"source {self.source.name!r}: cannot resume the data stream: {problem} since the position was"
                " saved (strict=True; with data.strict=false the source's stream restarts from its beginning instead)"
            )
        warnings.warn(
            f"source {self.source.name!r}: {problem} since the data position was saved; this source's stream"
            " restarts from its beginning (data.strict=true refuses instead)",
            DataChangedWarning,
            stacklevel=2,
        )
        state.update(fresh_packing_state(state["skipped"], state.get("truncated", 0), state.get("dropped", 0)))

    def _mark(self, cursor: Cursor) -> None:
        """Record which data `cursor` points into, for `check_data` on resume (one stat and read per file)."""
        where = (cursor.epoch, cursor.file)
        if self._stamped[0] != where:
            self._stamped = (where, self.source.stamp(cursor))
        self.state["parts"], self.state["stamp"] = self._digest, self._stamped[1]

    def windows(self) -> Iterator[list[int]]:
        state = self.state
        if state["done"]:
            return
        self.check_data()
        eos = self.tokenizer.eos_token_id
        partial: list[int] = []  # the start of the next window, always shorter than a window
        piece, skip = state.get("piece", 0), state["skip"]
        documents = self.source.documents(Cursor(*state["cursor"]), self.shard, self.num_shards, self.bad, self.endless)
        for start, after, text in documents:
            for at, ids, last in self._pieces(text, piece):
                if last:
                    ids.append(eos)
                if skip >= len(ids) and not last:  # resuming past this piece (a state saved before pieces existed)
                    skip -= len(ids)
                    continue
                used, skip = skip, 0
                while len(partial) + len(ids) - used >= self.window:
                    take = self.window - len(partial)
                    window = partial + ids[used : used + take]
                    used += take
                    partial = []
                    if used < len(ids) or not last:  # the next window starts in this piece, or right after it
                        state["cursor"], state["piece"], state["skip"] = start.to_list(), at, used
                        self._mark(start)
                    else:
                        state["cursor"], state["piece"], state["skip"] = after.to_list(), 0, 0
                        self._mark(after)
                    state["skipped"] = self.bad.count
                    yield window
                partial.extend(ids[used:])
            piece = 0
        state["skipped"] = self.bad.count
        state["done"] = True

    def _pieces(self, text: str, start: int) -> Iterator[tuple[int, list[int], bool]]:
        """(piece start, its ids, whether it is the document's last piece) from character `start` on."""
        pieces = self.tokenizer.pieces(text, start)
        current = next(pieces)
        for following in pieces:
            yield (*current, False)
            current = following
        yield (*current, True)


class PackedConversations(PackedSource):
    """Windows of `window` tokens from one shard of a conversation or prompt/completion source: whole
    examples (sft.py) packed greedily, never split across windows.

    An example that does not fit the rest of the window starts the next one, and the rest of the window is
    padding (EOS tokens, no labels). An example longer than a window is cut to the window (`overlong:
    truncate`) or dropped (`drop`, and also when the cut would leave nothing trained); either is counted.
    Each window comes out as (tokens [window], labels [window - 1], positions [window - 1]), built by
    `conversation_window`.

    State: after each window, `cursor` names the example the next window starts with (an example that did not
    fit is read again on resume), so the state is the same few integers as for text (`piece`, `skip` stay 0),
    plus the truncated and dropped counts. A finite stream (`endless=False`) pads its last window and sets `done`.

    Images (the encoder's `images`, data.images): an example's images travel with it, and an example whose images
    do not fit the rest of the window's image slots starts the next window too. A cut keeps the images whose
    placeholder runs lie wholly before it, cutting before a run it would split. Each window then also carries its
    images' tensors (image_records.IMAGE_KEYS, `window_image_tensors`).
    """

    def __init__(self, source: Any, encoder: Any, window: int, shard: int, num_shards: int, endless: bool,
                 strict: bool, state: dict[str, Any], overlong: str = "truncate") -> None:  # fmt: skip
        super().__init__(source, encoder.tokenizer, window, shard, num_shards, endless, strict, state)
        self.encoder = encoder
        self.overlong_mode = overlong
        self.overlong = OverlongRecords(source.name, state.get("truncated", 0), state.get("dropped", 0), self.kind)
        self.images = getattr(encoder, "images", None)  # image_records.ImageOptions, or None: no images

    kind = "conversation"  # what an item is called in the reports
    cut_fails = "truncated, nothing trained would be left"  # why a cut item is dropped

    def _length(self, example: Example) -> int:
        return len(example.ids)

    def _cut(self, example: Example) -> Example | None:
        """The example truncated to the window (before an image's run the window would split), or None when
        nothing trained would be left."""
        end = self.window
        runs = [(start, start + image.placeholder_count) for start, image in zip(example.image_starts, example.images)]
        end = next((start for start, stop in runs if stop > end), end)
        if not any(example.trained[1:end]):
            return None
        kept = sum(stop <= end for _, stop in runs)
        return Example(
            example.ids[:end], example.trained[:end], example.where,
            images=example.images[:kept], image_starts=example.image_starts[:kept],
        )  # fmt: skip

    def _room(self, items: list[Any], item: Any) -> bool:
        """Whether a window holding `items` has image slots for `item`'s images (always, without images)."""
        if self.images is None:
            return True
        return fits_window([image for e in items for image in e.images], list(item.images), self.images)

    def _window_of(self, examples: list[Example]) -> tuple[Any, ...]:
        window = conversation_window([(e.ids, e.trained) for e in examples], self.window, self.tokenizer.eos_token_id)
        if self.images is None:
            return window
        return (*window, *window_image_tensors([image for e in examples for image in e.images], self.images))

    def windows(self) -> Iterator[tuple[list[int], ...]]:  # type: ignore[override]
        if self.state["done"]:
            return
        cursor, documents = self._encoded()
        current: list[Any] = []
        used = 0
        placed = cursor.epoch  # the epoch of the last item placed in a window
        for start, after, item in documents:
            length = self._length(item)
            if length > self.window:
                try:
                    cut = None if self.overlong_mode == "drop" else self._cut(item)
                except BadRecord as error:  # a cut pair with nothing to prefer: skipped, or refused when strict
                    self.bad(item.where, str(error))
                    self._check_progress(start.epoch, placed)
                    continue
                if cut is None:
                    why = f"{item.size} tokens, a window holds {self.window}" + (
                        "" if self.overlong_mode == "drop" else f"; {self.cut_fails}"
                    )
                    self.overlong.drop(item.where, why)
                    self._check_progress(start.epoch, placed)
                    continue
                if current:  # the cut item fills a window of its own
                    yield self._emit(current, start)
                    current, used = [], 0
                self.overlong.truncate(item.where, item.size, self.window)
                item, length = cut, self._length(cut)
            elif used + length > self.window or not self._room(current, item):
                yield self._emit(current, start)
                current, used = [], 0
            placed = start.epoch
            current.append(item)
            used += length
            if used == self.window:
                yield self._emit(current, after)
                current, used = [], 0
        if current:  # a finite stream's last window
            yield self._emit(current, None)
        self._finish()

    def _encoded(self) -> tuple[Cursor, Iterator]:
        """Where the stream resumes (the state's cursor) and the encoded records from there, the data checked
        first: what every packer of encoded records walks."""
        self.check_data()
        cursor = Cursor(*self.state["cursor"])
        return cursor, self.source.documents(
            cursor, self.shard, self.num_shards, self.bad, self.endless, read=self.encoder
        )  # fmt: skip

    def _finish(self) -> None:
        """The stream is exhausted (a finite one): the counts in the state, and no more windows on resume."""
        self._count()
        self.state["done"] = True

    def _check_progress(self, epoch: int, placed: int) -> None:
        """Raise when a whole epoch went by without an item placed (`placed`: the epoch of the last one): every
        one was too long, or cut to nothing to learn, and an endless stream would spin."""
        if epoch > placed + 1:
            raise RuntimeError(
                f"source {self.source.name!r}: shard {self.shard} of {self.num_shards} dropped every"
                f" {self.kind} of a whole epoch as longer than a window of {self.window} tokens; raise"
                " seq_len, or set data.overlong: truncate"
            )

    def _emit(self, items: list[Any], next_start: Cursor | None) -> tuple[list[int], ...]:
        """The window of `items`, with the state moved to `next_start` (the next window's first item)."""
        if next_start is not None:
            self.state["cursor"], self.state["piece"], self.state["skip"] = next_start.to_list(), 0, 0
            self._mark(next_start)
        self._count()
        return self._window_of(items)

    def _count(self) -> None:
        self.state["skipped"] = self.bad.count
        self.state["truncated"], self.state["dropped"] = self.overlong.truncated, self.overlong.dropped


class PackedPairs(PackedConversations):
    """Windows of `window` tokens from one shard of a preference source: whole pairs (preference.py), each
    pair's chosen sequence then its rejected sequence, packed greedily and never split across windows; the
    rest of a window is padding. Each window comes out as (tokens [window], labels [window - 1], positions
    [window - 1], preference [window - 1]), built by `pair_window`.

    An overlong pair (both sequences longer than a window together) has its reply tails cut
    (`preference.fit_pair`, `overlong: truncate`) and fills a window of its own, or is dropped (`drop`, and
    when the cut would leave a reply without a trained token); either is counted as for conversations.
    State and resume as `PackedConversations`: the cursor names the pair the next window starts with."""

    kind = "preference pair"
    cut_fails = "cut, a reply would keep no trained token"

    def _length(self, pair: Any) -> int:
        return pair.length

    def _cut(self, pair: Any) -> Any:
        """`pair` cut to the window (`fit_pair`); a BadRecord when the cut leaves the same tokens on both sides."""
        from step35.data.preference import fit_pair, same_in_window

        cut = fit_pair(pair, self.window)
        if cut is not None and same_in_window(pair, cut):
            raise BadRecord(
                f"'chosen' and 'rejected' differ only past the window: cut to fit the window of {self.window} tokens,"
                f" they are the same tokens ({pair.size} before the cut), so the pair has nothing to prefer; raise"
                " data.seq_len so that the window holds where they differ, or shorten the replies"
            )
        return cut

    def _window_of(self, pairs: list[Any]) -> tuple[list[int], ...]:
        sides = [(e.ids, e.trained) for pair in pairs for e in (pair.chosen, pair.rejected)]
        return pair_window(sides, self.window, self.tokenizer.eos_token_id)


def pair_window(
    sequences: list[tuple[list[int], list[bool]]], window: int, pad_id: int
) -> tuple[list[int], list[int], list[int], list[int]]:
    """(tokens, labels, positions, preference) of one window holding preference pairs: `sequences` lists
    (ids, trained per token) of pair 0's chosen, pair 0's rejected, pair 1's chosen, ... Tokens, labels and
    positions as `conversation_window` (each sequence one document). preference [window - 1], label-aligned:
    slot i holds the sequence token i lies in, 2 * p for pair p's chosen and 2 * p + 1 for its rejected, -1
    for padding."""
    if len(sequences) % 2:
        raise ValueError(f"{len(sequences)} sequences: preference pairs come as chosen, rejected")
    tokens, labels, positions = conversation_window(sequences, window, pad_id)
    preference: list[int] = []
    for q, (ids, _) in enumerate(sequences):
        preference += [q] * len(ids)
    preference += [-1] * (window - len(preference))
    return tokens, labels, positions, preference[: window - 1]


def conversation_window(
    examples: list[tuple[list[int], list[bool]]], window: int, pad_id: int
) -> tuple[list[int], list[int], list[int]]:
    """(tokens, labels, positions) of one window holding `examples` (ids, trained per token) then padding.

    tokens [window]: the examples' ids, then `pad_id` up to `window`. labels [window - 1]: the targets of
    tokens[:-1], i.e. labels[i] = tokens[i + 1] where that token is trained and belongs to the same example
    as token i, else IGNORE_INDEX: no label crosses from one example into the next (an example's last token
    predicts nothing), and padding is never a target. positions [window - 1]: restart at 0 where an example
    starts; the padding counts as one more document (positions 0, 1, ... from its start), so it attends only
    to itself and never into an example."""
    tokens: list[int] = []
    trained: list[bool] = []
    starts: list[bool] = []
    for ids, flags in examples:
        tokens += ids
        trained += flags
        starts += [True] + [False] * (len(ids) - 1)
    if len(tokens) > window:
        raise ValueError(f"examples of {len(tokens)} tokens do not fit a window of {window}")
    pad = window - len(tokens)
    tokens += [pad_id] * pad
    trained += [False] * pad
    starts += [True] + [False] * (pad - 1) if pad else []
    labels = [t if trained[i] and not starts[i] else IGNORE_INDEX for i, t in enumerate(tokens)][1:]
    positions, position = [], 0
    for i in range(window - 1):
        position = 0 if starts[i] else position + 1
        positions.append(position)
    return tokens, labels, positions


def text_window_targets(tokens: list[int], eos_token_id: int) -> tuple[list[int], list[int]]:
    """(labels, positions) of a text window in a stream that also holds conversations, so that every batch
    has the same keys: every next token is a target (as the model's own shift does for text), positions
    restart after every EOS (as `document_positions`)."""
    positions, position = [], 0
    for i in range(len(tokens) - 1):
        position = 0 if i == 0 or tokens[i - 1] == eos_token_id else position + 1
        positions.append(position)
    return tokens[1:], positions


def document_positions(input_ids: torch.Tensor, eos_token_ids: list[int]) -> torch.Tensor:
    """Positions that restart at 0 in every document of packed windows (for `data.document_masking`).

    input_ids [B, S] (the model's inputs); a document starts at column 0 and right after every EOS
    token. Returns int64 [B, S], e.g. [5, 6, EOS, 9, 9] -> [0, 1, 2, 0, 1]. The model derives both its
    RoPE positions and the attention's document mask (step35.kernels.masks.DocumentMask) from this."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
    B, S = input_ids.shape
    starts = torch.zeros((B, S), dtype=torch.bool, device=input_ids.device)
    starts[:, 0] = True
    eos = torch.tensor(eos_token_ids, dtype=input_ids.dtype, device=input_ids.device)
    starts[:, 1:] = torch.isin(input_ids[:, :-1], eos)
    column = torch.arange(S, device=input_ids.device).expand(B, S)
    last_start = torch.where(starts, column, 0).cummax(dim=1).values
    return column - last_start
