"""Step35DataModule: raw text, conversations, prompt/completion or preference pairs in, packed token windows out,
with exact per-rank resume."""

import dataclasses
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only, rank_zero_warn
from torchdata.stateful_dataloader import StatefulDataLoader

from step35.data.agent_check import AgentRenderingWarning, check_agent_sources
from step35.data.bad_records import COUNT_KINDS, SkippedRecordsLog
from step35.data.builtin import builtin_corpus_path, builtin_tokenizer_dir
from step35.data.chat_messages import ChatTemplateError, check_train_choice
from step35.data.formats import DATA_FORMATS, FORMATS, check_not_mixed, format_of
from step35.data.image_records import ImageOptions
from step35.data.packing import document_positions
from step35.data.readers import TxtMode
from step35.data.resume import TrainBatches, TrainStreamResume
from step35.data.sft import OVERLONG, resolve_template
from step35.data.sources import Holdout, Source
from step35.data.spec import TXT_MODES, SourceSpec, open_source
from step35.data.stream import TokenWindows
from step35.data.tokenizer import TextTokenizer
from step35.data.validation import FixedBatches, validation_batches
from step35.data.window_fit import check_sources_fit

BUILTIN_VAL_FRACTION = 0.05  # the built-in corpus is small; this keeps about 8 documents for validation
DEFAULT_VAL_FRACTION = 0.01  # user data without val_files: 1% of the documents of every source


class Step35DataModule(pl.LightningDataModule):
    """Streams raw text, tokenizes it on the fly and packs it into windows: batches are
    {"input_ids": LongTensor [micro_batch_size, seq_len + 1]}; the model shifts inputs and labels itself.
    Conversation and prompt/completion sources (`format`) add "labels" and "position_ids" [micro_batch_size,
    seq_len] to every batch: -100 where a token is not trained, positions restarting per conversation.

    Training is one endless stream (stop it with Trainer(max_steps=...)); validation is a fixed set of
    `val_batches` batches. The exact stream position of every rank and worker is saved in checkpoints.
    docs/data.md describes formats, sources, sharding and resume.

    Args:
        files: Training text (short form of `sources`): paths, folders or globs (`**` recurses) of .jsonl, .json,
            .txt, .md, .parquet and .arrow files, or `save_to_disk` folders. Without `weights` all of them form
            one source; with `weights` each entry is its own source. No `files`, `sources` or `hub_dataset`:
            the built-in corpus (Python's own documentation), or the built-in records of `format` where it
            has some (formats.py): with `format: chat` the built-in conversations made from the corpus
            (questions answered with its paragraphs; builtin_chat.py), with `format: preference` the built-in
            preference pairs made from those (builtin_chat.py). `builtin` names them whatever `format` says.
        weights: Sampling weight of each `files` entry, as shares of training tokens (normalised).
        text_field: Field of json records, or column of parquet/arrow data, holding the text; the default for
            every source of `sources` that names none.
        txt_mode: What a document is in .txt/.md files: the whole "file", each "line", or each "paragraph"
            (blocks separated by blank lines); the default for `sources` too.
        hub_dataset: Instead of `files`: a `datasets.load_dataset` path (a hub name or a local folder), streamed.
        hub_name: Configuration name of `hub_dataset`.
        hub_split: Split of `hub_dataset`.
        sources: Instead of `files`/`weights`/`hub_dataset`: a list of sources, each with its own `text_field`
            and `weight`: `[{path: ..., text_field: ..., weight: ...}, {hub: ..., subset: ..., split: ...}]`
            (fields: step35.data.spec.SourceSpec).
        tokenizer: A Hugging Face tokenizer folder (with tokenizer.json). None: the built-in byte-level BPE.
        eos_token_id: EOS id appended after every document; None: read from the tokenizer folder.
        seq_len: Tokens the model sees per sample; windows hold seq_len + 1 tokens for the shifted labels.
        micro_batch_size: Windows per batch on each rank.
        num_workers: DataLoader worker processes per rank (0: load in the training process).
        val_files: Held-out text, like `files`; excludes `val_fraction`.
        val_fraction: Fraction of the documents of every source held out for validation, chosen by a hash of
            their position. None: 0.05 for the built-in corpus, 0.01 for other data (validation is then skipped,
            with a warning, when that holds less than one window), 0 with `val_files` or `val_batches=0`.
            0: no validation.
        val_batches: Validation batches per rank at each validation (0: no validation).
        strict: Raise on a bad record (naming file and line) instead of skipping, counting and warning; and
            refuse to resume when a source's data changed since the checkpoint, instead of restarting that
            source's stream with a warning.
        seed: Seed of the file order per epoch and of the source mixing.
        cache_dir: Folder for the built-in corpus and tokenizer; None: $STEP35_CACHE or ~/.cache/step35.
        builtin_vocab_size: Vocabulary size of the built-in tokenizer.
        document_masking: Attention stays inside each document of a packed window and positions restart
            per document: batches then also hold "position_ids" [micro_batch_size, seq_len] (0 where a
            document starts: column 0 and after every EOS), which the model turns into RoPE positions
            and its attention mask. Labels are unchanged (an EOS still predicts the next document's first
            token).
        format: The format of every source that states none: "text", "chat" (records with `messages`),
            "prompt_completion" (records with `prompt` and `completion`), or "auto": decided per source from
            its first records, and said at start. Conversation and prompt/completion batches also hold
            "labels" [micro_batch_size, seq_len] (-100 where not trained) and "position_ids" (docs/data.md).
            "preference": records with `chosen` and `rejected` (and an optional `prompt`), for
            `--model.objective dpo`; its batches also hold "preference" [micro_batch_size, seq_len] (which
            sequence of which pair each slot belongs to; preference.py, docs/data.md). formats.py lists every
            format. Sources whose batches are for different objectives cannot be mixed; `batch_keys` says which
            tensors this datamodule's batches add, `preference` whether they are preference pairs.
        train_on: Which tokens of a conversation are trained: "assistant" (every assistant turn), "last_assistant"
            (the final one), "all" (every token; for prompt/completion pairs, the prompt too).
        train_reasoning: False: the reasoning text of the trained assistant turns (a reasoning field, or a
            `<think>` block inline in the content, as the chat template renders it) is not trained; its
            `<think>`/`</think>` wrappers, the content, tool calls and end-of-turn token stay trained. Reasoning
            the template drops (earlier turns, for some templates) is never in the tokens either way.
        chat_template: A .jinja file to render conversations with, instead of the tokenizer folder's template.
            (The built-in tokenizer's folder carries step35's default template.)
        chat_template_kwargs: Variables every conversation is rendered with, as transformers'
            apply_chat_template(**kwargs) passes them: e.g. `{reasoning_effort: high}` for a release whose
            template has reasoning-effort levels, `{enable_thinking: false}`. A name the template does not read
            is refused, listing those it reads.
        overlong: A conversation longer than seq_len + 1 tokens is cut to the window ("truncate") or dropped
            ("drop"); both are counted (`data/truncated/<source>`, `data/dropped/<source>`) and reported. A
            preference pair whose two sequences do not fit one window together has its reply tails cut, the
            longer reply first, keeping a trained token each ("truncate"), or is dropped; counted the same way.
        builtin: The built-in records trained on when no `files`, `sources` or `hub_dataset` are given: the
            name of a format that has some ("chat", "preference", "unpaired", "prompt"), "text" (the corpus), or
            "images" (shapes and colours drawn with Pillow, with questions about them: builtin_images.py; needs
            `images`).
            None: those of `format`. A config can so keep `format: auto`, for the files a user adds, and train on
            the built-in conversations without them (configs/tiny-sft.yaml).
        max_dropped_share: At setup, the first 200 records of each conversation source are encoded and measured
            against the window (window_fit.py): where some would be dropped (longer than the window under
            `overlong: drop`, or cut to nothing trained), a warning says how many and the seq_len that holds them
            all; where their share is above this, the run stops, saying so. 1 never stops.
        images: Train on the images of conversations (a Step-3.7 model with `model.vision`): `{}` for the release's
            views (728-pixel global view, 504-pixel crops), or image_records.ImageOptions' fields (view_size,
            crop_size, max_images and max_crops per window). Image parts and `images` fields are read relative to
            the data file, placed as their placeholder runs, packed with their records, and every batch carries
            the pixel tensors (image_records.py: the batch contract). None: a record with images stops the run.
        check_agent_rendering: At setup (rank 0), render the first 200 records of each conversation source that
            carry tool calls or reasoning with the chat template, read each assistant turn back as a Step-3.5
            server reads it (reasoning split at `</think>`, tool calls in the step3p5 syntax) and warn, with the
            count and the first 5 differences, where it does not give back the record (agent_check.py).
    """

    def __init__(
        self,
        files: str | list[str] | None = None,
        weights: list[float] | None = None,
        text_field: str = "text",
        txt_mode: TxtMode = "file",
        hub_dataset: str | None = None,
        hub_name: str | None = None,
        hub_split: str = "train",
        sources: list[SourceSpec] | None = None,
        tokenizer: str | None = None,
        eos_token_id: int | None = None,
        seq_len: int = 256,
        micro_batch_size: int = 4,
        num_workers: int = 0,
        val_files: str | list[str] | None = None,
        val_fraction: float | None = None,
        val_batches: int = 8,
        strict: bool = False,
        seed: int = 0,
        cache_dir: str | None = None,
        builtin_vocab_size: int = 1024,
        document_masking: bool = False,
        format: str = "auto",
        train_on: str = "assistant",
        train_reasoning: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        overlong: str = "truncate",
        check_agent_rendering: bool = False,
        builtin: str | None = None,
        max_dropped_share: float = 0.5,
        images: ImageOptions | None = None,
    ) -> None:
        super().__init__()
        files = [files] if isinstance(files, str) else files
        val_files = [val_files] if isinstance(val_files, str) else val_files
        _check_sizes(seq_len, micro_batch_size, num_workers, val_batches)
        _check_source_forms(files, weights, hub_dataset, sources)
        _check_choices(txt_mode, val_fraction, val_files, format, overlong)
        _check_builtin_and_share(builtin, max_dropped_share)
        check_train_choice(train_on, train_reasoning, "data")
        specs = _parsed_sources(sources)
        self.save_hyperparameters(ignore=["sources"])
        # Plain dicts in the checkpoint's hyperparameters: loadable without trusting any class.
        self.hparams["sources"] = [dataclasses.asdict(s) for s in specs] if specs is not None else None
        self.images = ImageOptions.of(images)
        if builtin == "images" and self.images is None:
            raise ValueError(
                "data.builtin: images needs data.images (the tiny-vl views: {view_size: 112, crop_size: 56})"
            )
        self.hparams["images"] = dataclasses.asdict(self.images) if self.images is not None else None
        # where the documents come from and what a document is
        self.files, self.weights, self.sources, self.seed = files, weights, specs, seed
        self.hub_dataset, self.hub_name, self.hub_split = hub_dataset, hub_name, hub_split
        self.text_field, self.txt_mode, self.format, self.strict = text_field, txt_mode, format, strict
        # tokens and windows; eos_token_id is the resolved id after setup()
        self.tokenizer_path, self.eos_token_id, self.cache_dir = tokenizer, eos_token_id, cache_dir
        self.builtin_vocab_size, self.document_masking = builtin_vocab_size, document_masking
        self.seq_len, self.micro_batch_size, self.num_workers = seq_len, micro_batch_size, num_workers
        # validation
        self.val_files, self.val_fraction, self.val_batches = val_files, val_fraction, val_batches
        # conversations: what is trained, and how they are rendered
        self.train_on, self.train_reasoning, self.overlong = train_on, train_reasoning, overlong
        self.chat_template, self.chat_template_kwargs = chat_template, dict(chat_template_kwargs or {})
        self.check_agent_rendering = check_agent_rendering
        self.builtin, self.max_dropped_share = builtin, max_dropped_share
        self._init_state()

    def _init_state(self) -> None:
        """What setup(), the loaders and resume fill in later."""
        self._stream_options: dict[str, Any] = {}  # the chat template and options, for TokenWindows (after setup)
        self._step_repeats = 1  # repeat_batches
        self.tokenizer: TextTokenizer | None = None
        self._train_sources: list[Source] = []
        self._train_weights: list[float] = []
        self._val_sources: list[Source] = []
        self._val_fraction_is_default = False
        self._val_cache: tuple[int, int, list[dict[str, torch.Tensor]]] | None = None
        self._val_skipped: dict[str, int] = {}
        self._resume = TrainStreamResume(self.num_workers)
        self._skipped_log = SkippedRecordsLog()
        self._skipped_logged: tuple[int, dict[str, int]] | None = None  # (step, totals) last sent to the loggers

    # -- setup -------------------------------------------------------------------------------------------------

    @property
    def uses_builtin_corpus(self) -> bool:
        return not self.files and not self.hub_dataset and not self.sources

    def prepare_data(self) -> None:
        # Lightning runs this once per node before setup(); the builtin files are written atomically anyway.
        if self.uses_builtin_corpus:
            self.source_specs()  # writes the built-in records it names
        if self.tokenizer_path is None:
            builtin_tokenizer_dir(self.builtin_vocab_size, self.cache_dir, image_tokens=self.images is not None)

    def source_specs(self) -> list[SourceSpec]:
        """The training sources asked for, the short form spelled out as `sources`."""
        if self.sources is not None:
            return list(self.sources)
        if self.hub_dataset:
            return [SourceSpec(hub=self.hub_dataset, subset=self.hub_name, split=self.hub_split)]
        if self.files:
            if self.weights is not None:
                return [SourceSpec(path=entry, weight=w) for entry, w in zip(self.files, self.weights)]
            return [SourceSpec(path=self.files)]
        if self.builtin == "images":  # the built-in image conversations (builtin_images.py; data.images)
            from step35.data.builtin_images import builtin_images_path

            return [SourceSpec(path=str(builtin_images_path(self.cache_dir)), name="builtin-images", format="chat")]
        # the built-in records of `builtin`, else of `format` (e.g. conversations made from the corpus)
        builtin = DATA_FORMATS.get(self.builtin or self.format)
        if builtin is not None and builtin.builtin is not None:
            return [SourceSpec(path=str(builtin.builtin(self.cache_dir)), name=f"builtin-{builtin.name}")]
        return [SourceSpec(path=str(builtin_corpus_path(self.cache_dir)), name="builtin")]

    def setup(self, stage: str | None = None) -> None:
        """Resolve the tokenizer and the sources; every way the run cannot work fails here, by name."""
        if self.tokenizer is not None:
            return
        folder = self.tokenizer_path or builtin_tokenizer_dir(
            self.builtin_vocab_size, self.cache_dir, image_tokens=self.images is not None
        )
        tokenizer = TextTokenizer.from_folder(folder, self.eos_token_id)

        val_fraction = self.val_fraction
        if val_fraction is None:
            val_fraction = BUILTIN_VAL_FRACTION if self.uses_builtin_corpus else DEFAULT_VAL_FRACTION
            val_fraction = 0.0 if self.val_files or self.val_batches == 0 else val_fraction
        train_holdout = Holdout(val_fraction, "train") if val_fraction else None
        val_holdout = Holdout(val_fraction, "val") if val_fraction else None
        specs = self.source_specs()
        names = _unique_names([spec.display_name for spec in specs])

        def open_all(holdout: Holdout | None, shuffle: bool) -> list[Source]:
            return [
                open_source(spec, self.text_field, self.txt_mode, holdout, shuffle, self.seed, name, self.format)
                for spec, name in zip(specs, names)
            ]

        train_sources = open_all(train_holdout, shuffle=True)
        val_sources = open_all(val_holdout, shuffle=False) if val_holdout else []
        if self.val_files:
            val_sources = [open_source(SourceSpec(path=self.val_files), self.text_field, self.txt_mode, None,
                                       shuffle=False, seed=self.seed, format=self.format)]  # fmt: skip
        check_not_mixed(train_sources + val_sources)
        stream_options = self._chat_options(folder, train_sources + val_sources)
        if self.check_agent_rendering and rank_zero_only.rank == 0:
            _warn_agent_rendering(train_sources, stream_options.get("template"), tokenizer)
        # every rank finds the same (the same first records), so every rank stops alike
        check_sources_fit(
            train_sources, tokenizer, self.seq_len, stream_options, self.max_dropped_share, rank_zero_warn
        )

        # Set last, so that a failed setup() fails again when called again.
        self._train_sources, self._val_sources = train_sources, val_sources
        self._train_weights = [spec.weight for spec in specs]
        self._val_fraction_is_default = self.val_fraction is None and not self.val_files
        self.tokenizer, self.eos_token_id = tokenizer, tokenizer.eos_token_id
        self._stream_options = stream_options
        for source in train_sources:
            rank_zero_info(f"source {source.name!r}: format {source.format} ({source.format_reason})")
        self._announce_validation(val_fraction)

    def _chat_options(self, tokenizer_folder: Any, sources: list[Source]) -> dict[str, Any]:
        """The stream options for conversation sources: the chat template (resolved only when a source needs
        it; a chat source without one is an error naming the tokenizer folder and data.chat_template)."""
        options: dict[str, Any] = {
            "train_on": self.train_on,
            "train_reasoning": self.train_reasoning,
            "overlong": self.overlong,
        }
        if self.images is not None:
            options["images"] = self.images
        formats = [format_of(source) for source in sources]
        if not any(f.whole_records for f in formats):
            if self.chat_template_kwargs:
                rank_zero_warn(
                    f"data.chat_template_kwargs {sorted(self.chat_template_kwargs)}: no source holds conversations,"
                    " so no chat template is rendered and they change nothing"
                )
            return options
        refusals = [f.train_on_all_refused for f in formats if f.train_on_all_refused]
        if self.train_on == "all" and refusals:
            raise ValueError(refusals[0])
        from pathlib import Path

        template, missing = resolve_template(Path(tokenizer_folder), self.chat_template)
        if template is not None:  # else every record would fail to render, each skipped as a bad record
            try:
                template.check_syntax()
            except ChatTemplateError as error:  # the folder's template is named by its file name alone
                where = "" if self.chat_template else f"{Path(tokenizer_folder) / template.origin}: "
                raise ChatTemplateError(f"{where}{error}; fix it, or set data.chat_template to a .jinja file") from None
        chat = sorted({s.name for s, f in zip(sources, formats) if f.needs_template})  # others: per record
        if template is None and chat:
            raise ValueError(f"source(s) {chat} hold conversations, but {missing}")
        if template is not None and self.chat_template_kwargs:
            template = template.with_variables(self.chat_template_kwargs, "data.chat_template_kwargs")
        return {**options, "template": template, "template_missing": missing}

    def _announce_validation(self, val_fraction: float) -> None:
        """Say at start where validation data comes from, or that there is none and how to get it."""
        if self.val_batches == 0:
            rank_zero_info("validation: off (data.val_batches=0)")
        elif self.val_files:
            rank_zero_info(f"validation: {self.val_batches} batches per rank from data.val_files")
        elif val_fraction:
            how = "" if self.val_fraction is not None else " (default; data.val_fraction sets it, 0 turns it off)"
            rank_zero_info(f"validation: {val_fraction:.2%} of the documents of every source held out{how}")
        else:
            rank_zero_info(
                "validation: off (data.val_fraction=0 and no data.val_files); set data.val_fraction (e.g. 0.01)"
                " or data.val_files to validate"
            )

    def generation_stop_ids(self) -> set[int]:
        """The ids that end a text the model generates (online RL's rollouts; after setup): the tokenizer's EOS,
        and the chat template's end-of-turn token when the sources are rendered with one."""
        stop = {self.tokenizer.eos_token_id}
        template = self._stream_options.get("template")
        if template is not None:
            try:
                stop.add(template.end_of_turn_id(self.tokenizer, where="data.chat_template"))
            except ChatTemplateError:
                pass  # no special token ends a reply: the EOS alone stops it
        return stop

    @property
    def batch_keys(self) -> tuple[str, ...]:
        """The tensors the batches add for an objective other than the language model's (after setup): the
        `batch_keys` of the sources' format, stated or detected ("preference" for preference pairs), or ()."""
        return next((f.batch_keys for f in map(format_of, self._train_sources) if f.batch_keys), ())

    @property
    def preference(self) -> bool:
        """Whether the batches are preference pairs (carry "preference"; after setup). The DPO objective needs
        them; the language-model objective refuses them."""
        return "preference" in self.batch_keys

    @property
    def image_token_id(self) -> int | None:
        """The tokenizer's `<im_patch>` id, which the model's image features replace (after setup; None without
        data.images)."""
        if self.images is None:
            return None
        from step35.data.images import ImageTokens

        tokens = ImageTokens()
        return tokens.ids(self._ready_tokenizer().tokenizer)[tokens.image]

    @property
    def vocab_size(self) -> int:
        """Size of the tokenizer's vocabulary, special tokens included (after setup)."""
        return self._ready_tokenizer().vocab_size

    def check_model_vocab(self, model_vocab_size: int) -> None:
        """Raise if the tokenizer can produce ids the model's embedding does not have."""
        if self.vocab_size > model_vocab_size:
            raise ValueError(
                f"the tokenizer ({self._ready_tokenizer().path}) has {self.vocab_size} tokens, more than the"
                f" model's vocab_size of {model_vocab_size}; ids >= {model_vocab_size} would index past the embedding"
            )

    def _ready_tokenizer(self) -> TextTokenizer:
        if self.tokenizer is None:
            self.setup()
        assert self.tokenizer is not None
        return self.tokenizer

    # -- loaders -----------------------------------------------------------------------------------------------

    def data_parallel_rank_and_size(self) -> tuple[int, int]:
        """(rank, number of ranks) among the data-parallel replicas; ranks that share a replica share data."""
        trainer = self.trainer
        if trainer is not None:
            kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None)
            if kwargs is not None:
                return kwargs["rank"], kwargs["num_replicas"]
            return trainer.global_rank, trainer.world_size
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1

    def train_dataloader(self) -> TrainBatches:
        self._ready_tokenizer()
        rank, world_size = self.data_parallel_rank_and_size()
        stream = TokenWindows(
            self._train_sources, self.tokenizer, self.seq_len, self._train_weights, rank, world_size, self.seed,
            endless=True, strict=self.strict, **self._stream_options,
        )  # fmt: skip
        loader = StatefulDataLoader(
            stream, batch_size=self.micro_batch_size, num_workers=self.num_workers, pin_memory=torch.cuda.is_available()
        )
        batches = TrainBatches(loader, self._planned_batches())
        self._resume.attach(batches, rank, world_size)
        if self._step_repeats > 1:
            trainer = self.trainer
            batches.repeat_steps(self._step_repeats, trainer.accumulate_grad_batches, lambda: trainer.global_step)
        return batches

    def repeat_batches(self, times: int) -> None:
        """Hand each optimizer step's batches `times` steps in a row (asked by an objective that trains several
        steps on one batch's rollouts: online RL's num_iterations; TrainBatches.repeat_steps)."""
        self._step_repeats = times

    def _planned_batches(self) -> int | None:
        """The batches this run will draw, if Lightning knows; see train_batches.py for why it must be told."""
        trainer = self.trainer
        if trainer is None:
            return None
        if trainer.max_steps > 0:
            return trainer.max_steps * trainer.accumulate_grad_batches
        if not isinstance(trainer.limit_train_batches, int):
            raise ValueError(
                "the training stream is endless: set Trainer(max_steps=...) (or an integer limit_train_batches)"
            )
        return None  # Lightning caps each epoch at limit_train_batches, which gives it a length

    def val_dataloader(self) -> Any:
        self._ready_tokenizer()
        if not self._val_sources or self.val_batches == 0:
            return []  # Lightning skips validation for an empty list of loaders
        rank, world_size = self.data_parallel_rank_and_size()
        if self._val_cache is None or self._val_cache[:2] != (rank, world_size):
            weights = self._train_weights if len(self._val_sources) == len(self._train_sources) else None
            try:
                batches, skipped = validation_batches(
                    self._val_sources, self.tokenizer, self.seq_len, self.micro_batch_size, self.val_batches,
                    rank, world_size, weights, self.seed, self.strict, on_repeat=rank_zero_info,  # once per job
                    **self._stream_options,
                )  # fmt: skip
            except ValueError as error:
                if not self._val_fraction_is_default:
                    raise
                # The default holdout of a small corpus can hold less than one window: no reason to fail a run
                # that did not ask for validation.
                warnings.warn(f"validation is off: {error}", stacklevel=2)
                self._val_sources = []
                return []
            self._val_cache = (rank, world_size, batches)
            self._val_skipped = {f"skipped_records/{s.name}": n for s, n in zip(self._val_sources, skipped)}
        return FixedBatches(self._val_cache[2])

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """With document_masking, add each window's document positions (computed on the host, before the
        batch moves to the device; train and validation batches alike). Batches that carry positions already
        keep the packer's: conversations, prompt/completion and preference pairs (one document per packed
        example: the EOS that ends an assistant turn inside a multi-turn conversation starts none)."""
        if self.document_masking and isinstance(batch, dict) and "input_ids" in batch and "position_ids" not in batch:
            if self.eos_token_id is None:
                raise RuntimeError("document_masking needs the EOS id: call setup() before drawing batches")
            batch = {**batch, "position_ids": document_positions(batch["input_ids"][:, :-1], [self.eos_token_id])}
        return batch

    def teardown(self, stage: str | None = None) -> None:
        self._resume.close()
        # Lightning calls this only after a fit that ended normally, after the strategy's teardown:
        # no collective here, the summary reports the last sync (normally the run's last batch).
        summary = self._skipped_log.summary() if stage == "fit" else None
        if summary is not None:
            rank_zero_info(summary)

    @property
    def skipped_records(self) -> dict[str, int]:
        """Bad records skipped so far, per source, over this rank's workers (training) and validation."""
        return self._counts("skipped_records")

    def _counts(self, kind: str) -> dict[str, int]:
        """A count of this rank's workers (training) and validation per source: skipped_records, truncated, dropped."""
        counts = {source.name: 0 for source in self._train_sources + self._val_sources}
        for key, n in [*self._train_skipped().items(), *self._val_skipped.items()]:
            key_kind, name = key.split("/", 1)
            if key_kind == kind:
                counts[name] += n
        return counts

    @property
    def overlong_records(self) -> dict[str, dict[str, int]]:
        """Conversations truncated and dropped so far, per source, over this rank's workers and validation."""
        return {"truncated": self._counts("truncated"), "dropped": self._counts("dropped")}

    def _train_skipped(self) -> dict[str, int]:
        """Counts keyed "<kind>/<source>" (bad_records.COUNT_KINDS) over this rank's workers."""
        kinds = {s.name: COUNT_KINDS if format_of(s).whole_records else COUNT_KINDS[:1] for s in self._train_sources}
        counts = {f"{kind}/{name}": 0 for name, ks in kinds.items() for kind in ks}
        for state in self._resume.worker_states():
            for source, s in zip(self._train_sources, state["sources"]):
                for kind in kinds[source.name]:
                    counts[f"{kind}/{source.name}"] += s.get("skipped" if kind == "skipped_records" else kind, 0)
        return counts

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Lightning's batch hook, used as the one point every rank passes at the same training batches:
        every `trainer.log_every_n_steps` steps and at the run's last step, the skipped-record counts of
        all ranks and workers are gathered (a collective) and logged as `data/skipped_records/<source>`
        once any is non-zero."""
        trainer = self.trainer
        if trainer is not None and trainer.training and self._resume.batches is not None:
            self._log_skipped_records(trainer)
        return batch

    def _log_skipped_records(self, trainer: "pl.Trainer") -> None:
        step = trainer.global_step
        final = 0 < trainer.max_steps <= step + 1  # every micro-batch of the last step: its reads are the last
        due = step % max(1, trainer.log_every_n_steps) == 0 and step != self._skipped_log.step
        if not (due or final):
            return
        rank, _ = self.data_parallel_rank_and_size()
        totals = self._skipped_log.sync(self._train_skipped(), dict(self._val_skipped), rank, step, final)
        if not trainer.is_global_zero or not any(totals.values()) or self._skipped_logged == (step, totals):
            return
        self._skipped_logged = (step, totals)
        for logger in trainer.loggers:
            logger.log_metrics(SkippedRecordsLog.metrics(totals), step=step)

    # -- checkpointing -----------------------------------------------------------------------------------------
    #
    # Lightning calls state_dict() on every rank while building a checkpoint (checkpoint_connector.py,
    # dump_checkpoint) but only rank 0 writes the non-tensor part, and every rank reads back rank 0's copy
    # (restore_datamodule): resume.py gathers every rank's stream position into it and hands each rank its own.

    def state_dict(self) -> dict[str, Any]:
        return self._resume.state_dict(*self.data_parallel_rank_and_size())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resume.load_state_dict(state_dict, *self.data_parallel_rank_and_size())


def _warn_agent_rendering(sources: list[Source], template: Any, tokenizer: TextTokenizer) -> None:
    """data.check_agent_rendering: warn where agent records do not round-trip through the template (agent_check.py)."""
    reports = check_agent_sources(sources, template, tokenizer) if template is not None else []
    if not reports:
        rank_zero_warn("data.check_agent_rendering: no source holds conversations rendered with a chat template")
    for name, report in reports:
        if report.failed:
            rank_zero_warn(report.summary(name), category=AgentRenderingWarning)
        else:
            rank_zero_info(report.summary(name))


def _unique_names(names: list[str]) -> list[str]:
    """Source names key the skipped-record counts: the same data twice (another text field) gets `#2`, `#3`."""
    seen: dict[str, int] = {}
    unique = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        unique.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
    return unique


def _check_sizes(seq_len: int, micro_batch_size: int, num_workers: int, val_batches: int) -> None:
    if seq_len < 1:
        raise ValueError(f"seq_len must be at least 1, got {seq_len}")
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be at least 1, got {micro_batch_size}")
    if num_workers < 0 or val_batches < 0:
        raise ValueError(f"num_workers and val_batches must be >= 0, got {num_workers} and {val_batches}")


def _check_source_forms(
    files: list[str] | None, weights: list[float] | None, hub_dataset: str | None, sources: list | None
) -> None:
    """Refuse the training data given two ways at once, and weights that do not fit `files`."""
    if files and hub_dataset:
        raise ValueError("give either files or hub_dataset, not both")
    if sources is not None and (files or hub_dataset or weights is not None):
        raise ValueError("give either sources or the short form (files, weights, hub_dataset), not both")
    if sources is not None and not sources:
        raise ValueError("sources is an empty list; give at least one source, or leave it unset")
    if weights is not None:
        if not files or len(weights) != len(files):
            raise ValueError(f"{len(weights)} weights for {len(files or [])} files entries; give one weight per entry")
        if any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(f"weights must be non-negative with a positive sum, got {weights}")


def _check_choices(
    txt_mode: str, val_fraction: float | None, val_files: list[str] | None, format: str, overlong: str
) -> None:
    if txt_mode not in TXT_MODES:
        raise ValueError(f"txt_mode must be 'file', 'line' or 'paragraph', got {txt_mode!r}")
    if val_fraction is not None and not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if val_files and val_fraction:
        raise ValueError("give either val_files or val_fraction, not both")
    for option, value, allowed in (("format", format, FORMATS), ("overlong", overlong, OVERLONG)):
        if value not in allowed:
            raise ValueError(f"data.{option} must be one of {allowed}, got {value!r}")


def _check_builtin_and_share(builtin: str | None, max_dropped_share: float) -> None:
    has_builtin = ["text", *(name for name, f in DATA_FORMATS.items() if f.builtin is not None), "images"]
    if builtin is not None and builtin not in has_builtin:
        raise ValueError(f"data.builtin must be one of {has_builtin} (formats with built-in records), got {builtin!r}")
    if not 0 <= max_dropped_share <= 1:
        raise ValueError(f"data.max_dropped_share must be in [0, 1], got {max_dropped_share}")


def _parsed_sources(sources: list | None) -> list[SourceSpec] | None:
    """`sources` as SourceSpecs (None stays None: the short form is used); their weights must sum above 0."""
    if sources is None:
        return None
    specs = [SourceSpec.parse(entry, i) for i, entry in enumerate(sources)]
    if sum(s.weight for s in specs) <= 0:
        raise ValueError(f"the sources' weights must have a positive sum, got {[s.weight for s in specs]}")
    return specs
