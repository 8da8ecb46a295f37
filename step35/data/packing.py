"""Packing one source's documents into fixed windows of tokens, resumable at every window."""

import warnings
from collections.abc import Iterator
from typing import Any

import torch

from step35.data.bad_records import BadRecords
from step35.data.resume import DataChangedError, DataChangedWarning
from step35.data.sources import Cursor
from step35.data.tokenizer import TextTokenizer


def fresh_packing_state(skipped: int = 0) -> dict[str, Any]:
    """The start of a source's stream. `parts` and `stamp` say which data the cursor points into (the source's
    digest, the stamp of the cursor's file); they are set with the first window and checked on resume."""
    return {"cursor": Cursor().to_list(), "piece": 0, "skip": 0, "done": False, "skipped": skipped,
            "parts": None, "stamp": None}  # fmt: skip


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
        state.update(fresh_packing_state(skipped=state["skipped"]))

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


def document_positions(input_ids: torch.Tensor, eos_token_ids: list[int]) -> torch.Tensor:
    """Positions that restart at 0 in every document of packed windows (for `data.document_masking`).

    input_ids [B, S] (the model's inputs); a document starts at column 0 and right after every EOS
    token. Returns int64 [B, S], e.g. [5, 6, EOS, 9, 9] -> [0, 1, 2, 0, 1]. The model derives both its
    RoPE positions and the attention's document mask (step35.kernels.DocumentMask) from this."""
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
