"""Step-3.7's vision side on the devices (`model.vision`, training/vision.py): what its forward keeps for backward
per micro-batch, predicted from what step35/model/vision.py saves (unique storages, parameters excluded), and its
transient work. Its weights, gradients and optimizer states are read from the built model (state.py), and its
FSDP units (each encoder block, then the rest of the encoder; the projector in the root) are state.fsdp_groups'.

Images per micro-batch: every window (record row) carries up to `data.images.max_images` global views of
`view_size` pixels and `max_crops` crops of `crop_size` (data/image_records.py); the plan counts them all full,
the worst window. One pass encodes every view of the micro-batch (model/vision.py VisionEncoder): the blocks on
all tokens packed, the two downsamplers on one canvas of the largest grid (a crop padded to the global view's).
Under context parallelism every rank encodes the same images.

What is kept depends on what trains (autograd saves an op's input only for a gradient it computes):
- `trained` (model.vision.train): every op from the patch embedding on keeps its inputs;
- `lora` (model.lora.targets "vision" and/or "vision_projector"): the frozen encoder keeps nothing before the first
  adapter (block 0's attn.out_proj); from there the adapters keep their inputs and their rank-r outputs, the
  LayerNorms and the attention kernel what the input gradient needs, the frozen linears nothing; the downsamplers
  keep their inputs (a convolution keeps its input whatever trains). "vision_projector" alone: the projector's
  adapter only;
- `frozen`: nothing (no parameter of the encoder asks for a gradient, nor do the pixels).

Under activation checkpointing (parallelize.checkpoint_blocks wraps every encoder block as it wraps the decoder
layers) a block that a gradient reaches keeps its input [P, D] instead of the tensors above; `selective` keeps its
matmul outputs too (parallelize._save_matmuls: the four linears, the LoRA adapters' two products, and on CUDA the
attention kernel's output and log-sum-exp; the CPU's attention kernel is recomputed). The rotary tables stay kept
(the checkpoint holds its arguments); the stem, the downsamplers and the projector are not checkpointed.

Conventions as activations.py: P tokens of all views packed, D the encoder width, I its MLP width, `a` bytes of an
activation (the dtype the encoder computes in), LayerNorm statistics and the attention's log-sum-exp fp32 (CUDA
kernels; the CPU keeps LayerNorm statistics in the input dtype). tests/test_plan_vision.py compares the total
against a count of the real saved tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from step35.config import VisionConfig
from step35.model.init import VISION_PREFIXES
from step35.model.vision import CHANNEL_GROWTH, feature_grid

FP32 = 4
MODES = ("trained", "lora", "frozen")
CHECKPOINTING = ("none", "selective", "full")


def is_vision(name: str) -> bool:
    """A parameter of the encoder or the projector (adapters on them included)."""
    return name.startswith(VISION_PREFIXES)


@dataclass(frozen=True)
class ViewGroup:
    """`count` square views of `side` pixels, encoded together."""

    count: int
    side: int


@dataclass(frozen=True)
class VisionGrad:
    """What of the vision side asks for gradients: the mode (MODES), and under LoRA which targets, the rank and
    the dropout of the adapters."""

    mode: str = "frozen"
    blocks: bool = False  # lora: the encoder blocks' linears are adapted ("vision")
    projector: bool = False  # lora: the projector is adapted ("vision_projector")
    rank: int = 0
    dropout: float = 0.0


@dataclass
class VisionActivations:
    """One micro-batch's vision forward: bytes kept for backward by part, per view, and its transients."""

    mode: str
    checkpointing: str = "none"  # of the encoder blocks: none | selective | full (activation_checkpointing)
    parts: dict[str, int] = field(default_factory=dict)  # kept until the vision backward
    per_view: dict[int, int] = field(default_factory=dict)  # kept bytes per view, by its side in pixels
    tokens: int = 0  # encoder tokens (patches) of all views
    features: int = 0  # image features handed to the language model
    features_bytes: int = 0  # the projector's output and its placeholder-order copy, alive until the splice
    block_work: int = 0  # one encoder block's tensors as training keeps them: the most one block holds at once

    @property
    def total(self) -> int:
        return sum(self.parts.values())


def _kept(parts: dict[str, int], part: str, nbytes: float) -> None:
    if nbytes:
        parts[part] = parts.get(part, 0) + int(nbytes)


def block_saved(cfg: VisionConfig, tokens: int, a: int, grad: VisionGrad, *, grad_in: bool) -> int:
    """Bytes one encoder block (VisionBlock.forward) keeps for `tokens` packed tokens; `grad_in`: its input asks
    for a gradient (when trained, every block's; under LoRA every block's after the first)."""
    P, D, I, heads = tokens, cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads
    ln_stats = 2 * P * FP32  # mean and rstd per token
    attention = 6 * P * D * a + heads * P * FP32  # the fused qkv storage (v is a view of it), rotated q and k, out; lse
    activation = (2 if cfg.hidden_act == "quick_gelu" else 1) * P * I * a  # c_fc's output (and quick-GELU's sigmoid)
    if grad.mode == "trained":
        # the inputs of ln_1, in_proj, out_proj, ls_1 (out_proj's output), ln_2, c_fc, ls_2 (c_proj's output)
        return 7 * P * D * a + 2 * ln_stats + attention + activation + P * I * a  # + c_proj's input
    if grad.mode != "lora" or not grad.blocks:
        return 0
    adapter_in = a + (1 if grad.dropout > 0 else 0)  # with dropout: the dropped input and its mask (bool)
    # out_proj, c_fc and c_proj adapters: their inputs and their rank-r outputs; ln_2's input; the activation
    kept = P * (2 * D + I) * adapter_in + 3 * P * grad.rank * a + P * D * a + ln_stats + activation
    if grad_in:
        kept += P * D * a + ln_stats + attention  # ln_1's input, the attention kernel's tensors
    return kept


def blocks_get_gradients(grad: VisionGrad) -> bool:
    """A gradient reaches the encoder blocks: they are trained, or adapted by LoRA ("vision")."""
    return grad.mode == "trained" or (grad.mode == "lora" and grad.blocks)


def checkpointed_block_saved(
    cfg: VisionConfig, tokens: int, a: int, grad: VisionGrad, checkpointing: str, device_type: str
) -> int:
    """Bytes one checkpointed encoder block keeps for `tokens` packed tokens: its input h [P, D], and under
    `selective` the matmul outputs parallelize._save_matmuls keeps. Nothing when no gradient reaches the block
    (the checkpoint then drops what it held)."""
    if not blocks_get_gradients(grad):
        return 0
    P, D, I = tokens, cfg.hidden_size, cfg.intermediate_size
    kept = P * D * a
    if checkpointing == "selective":
        kept += P * (3 * D + D + I + D) * a  # in_proj, out_proj, c_fc, c_proj (addmm)
        if grad.mode == "lora":  # each adapted linear's two mm: [P, r] and [P, out]
            kept += 3 * P * grad.rank * a + P * (D + I + D) * a
        if device_type == "cuda":  # the flash / efficient SDPA kernel's output and log-sum-exp
            kept += P * D * a + cfg.num_attention_heads * P * FP32
    return kept


def block_kept(
    cfg: VisionConfig, tokens: int, a: int, grad: VisionGrad, *, grad_in: bool, checkpointing: str, device_type: str
) -> int:
    """Bytes one encoder block keeps under the run's activation checkpointing (block_saved without it)."""
    if checkpointing not in CHECKPOINTING:
        raise ValueError(f"activation_checkpointing must be none, selective or full, got {checkpointing!r}")
    if checkpointing == "none":
        return block_saved(cfg, tokens, a, grad, grad_in=grad_in)
    return checkpointed_block_saved(cfg, tokens, a, grad, checkpointing, device_type)


def _grid(cfg: VisionConfig, group: ViewGroup) -> int:
    return group.side // cfg.patch_size


def _tokens(cfg: VisionConfig, group: ViewGroup) -> int:
    return group.count * _grid(cfg, group) ** 2


def _features(cfg: VisionConfig, group: ViewGroup) -> int:
    return group.count * feature_grid(_grid(cfg, group)) ** 2


def rotary_tables(cfg: VisionConfig, views: list[ViewGroup]) -> int:
    """The rotary cos and sin tables [T, head_dim / 2] fp32 of each view size present, kept by q's and k's
    rotations when the attention's input asks for a gradient."""
    return sum(2 * _grid(cfg, g) ** 2 * (cfg.head_dim // 2) * FP32 for g in views if g.count)


def encoder_saved(
    cfg: VisionConfig,
    views: list[ViewGroup],
    a: int,
    grad: VisionGrad,
    checkpointing: str = "none",
    device_type: str = "cuda",
) -> dict[str, int]:
    """Bytes VisionEncoder.forward and the projector keep for backward on `views`, by part (model/vision.py),
    the rotary tables apart (rotary_tables), with the blocks checkpointed as `checkpointing` says."""
    parts: dict[str, int] = {}
    trained = grad.mode == "trained"
    lora = grad.mode == "lora"
    D, P = cfg.hidden_size, sum(_tokens(cfg, g) for g in views)
    if trained:  # conv1's input (the patches); ln_pre's input and statistics
        _kept(parts, "vision patches", P * cfg.num_channels * cfg.patch_size**2 * a + P * D * a + 2 * P * FP32)
    for i in range(cfg.num_hidden_layers):
        grad_in = trained or i > 0
        kept = block_kept(cfg, P, a, grad, grad_in=grad_in, checkpointing=checkpointing, device_type=device_type)
        _kept(parts, "vision blocks", kept)
    if blocks_get_gradients(grad):  # a gradient reaches the downsamplers (a convolution keeps its input)
        side = max((_grid(cfg, g) for g in views), default=0)  # the canvas: every view padded to the largest grid
        half = -(-side // 2)
        N = sum(g.count for g in views)
        # downsampler1's input canvas, the in-view mask it is multiplied by, downsampler2's input
        _kept(parts, "vision downsample", N * (D * side * side + half * half + 2 * D * half * half) * a)
    if trained or (lora and grad.projector):  # the projector's input (adapter: dropped input + mask, its output)
        F = sum(_features(cfg, g) for g in views)
        adapter = F * (grad.rank * a + (CHANNEL_GROWTH * D if grad.dropout > 0 else 0)) if lora else 0
        _kept(parts, "vision projector", F * CHANNEL_GROWTH * D * a + adapter)
    return parts


def vision_activations(
    cfg: VisionConfig,
    text_hidden: int,
    views: list[ViewGroup],
    a: int,
    grad: VisionGrad,
    checkpointing: str = "none",
    device_type: str = "cuda",
) -> VisionActivations:
    """The vision forward of one micro-batch of `views` (each group as images_of_batch hands them over): kept
    bytes by part and per view of each size, and the transients (the features, one block's work), with the
    encoder blocks under activation checkpointing `checkpointing` on a `device_type` device. The projector's
    output is not kept (the splice, masked_scatter, keeps only its mask)."""

    def saved(groups: list[ViewGroup]) -> dict[str, int]:
        return encoder_saved(cfg, groups, a, grad, checkpointing, device_type)

    parts = saved(views)
    if blocks_get_gradients(grad):  # kept by the rotations, or held as the checkpointed blocks' arguments
        _kept(parts, "vision blocks", rotary_tables(cfg, views))
    empty = sum(saved([ViewGroup(0, g.side) for g in views]).values())
    per_view = {}
    for k, group in enumerate(views):  # what one more view of this size adds (in this micro-batch's canvas)
        one = [ViewGroup(int(j == k), g.side) for j, g in enumerate(views)]
        per_view[group.side] = sum(saved(one).values()) - empty
    F = sum(_features(cfg, g) for g in views)
    return VisionActivations(
        grad.mode,
        checkpointing,
        parts,
        per_view,
        tokens=sum(_tokens(cfg, g) for g in views),
        features=F,
        features_bytes=2 * F * text_hidden * a,
        block_work=block_saved(cfg, sum(_tokens(cfg, g) for g in views), a, VisionGrad("trained"), grad_in=True),
    )
