"""Step-3.7-Flash's vision side: the encoder (`vision_model.*`), the projector (`vit_large_projector.*`), the splice
of image features into the token embeddings, and the vision-language model around Step35ForCausalLM.

The encoder is a pre-LN ViT without a CLS token: a 14-pixel patch embedding (`conv1`, no bias) plus a learned
position table (`positional_embedding`, one row per patch of an `image_size` view, resized bilinearly to other
grids), `ln_pre`, blocks h += ls_1 * attn(ln_1(h)); h += ls_2 * mlp(ln_2(h)) (LayerScale `gamma`s, quick-GELU MLP,
2-D rotary attention), then two 3x3 stride-2 convolutions (`vit_downsampler1`, `vit_downsampler2`: D -> 2D -> 4D
channels, each halving the grid, rounding up) and the projector Linear(4D -> the text hidden size). There is no
final norm. A 728-pixel global view is 52 x 52 patches, 13 x 13 = 169 features; a 504-pixel crop 81.

Names are the release's, so `state_dict()` is what the release stores and loads as it is. Attention keeps the
release's fused `attn.in_proj_weight` [3D, D] (q, k, v rows) and its rotary layout: within each head the dims
(2p, 2p+1) turn together by angle_p (transformers permutes the q and k rows into halves when it loads them; here
they are used as stored). For a view of gh x gw patches, token t = row * gw + col, and pair p of the hd / 2 pairs
turns by col * f_p for p < hd / 4, by row * f_(p - hd/4) after, with f_j = rope_theta^(-4j / hd).

One pass for every view: global views and crops differ in size (728 and 504 pixels), and a module that FSDP
shards must be called the same number of times on every rank, whatever the images. So `VisionEncoder.forward`
takes groups of views ([n_k, 3, H_k, W_k], one size per group) and calls each of its modules once: patches of all
views go through `conv1` as one batch; the blocks run on all tokens packed together, attention kept within each
view; the downsamplers run on one canvas of the largest grid, each view in its top-left corner with zeros around
it (zero padding is what the convolution does at a view's edge; the first downsampler's output outside each view
is zeroed again before the second). A batch without images runs the same modules on an empty group.

Step35VLForConditionalGeneration is Step35ForCausalLM (its names, `model.*` and `lm_head.*`, unchanged) with
the encoder and projector beside it: the features replace the image placeholder tokens' embeddings, in order
(each image's crops, then its global view: transformers' Step3p7 order), and the language model runs on those.
`loss` does the same for training: the features are spliced into the whole rows' embeddings, before the language
model's loss splits the rows for context parallelism (each cp rank encodes the same images and takes its share).
`images_of_batch` turns the data's fixed-shape image tensors (step35/data/image_records.py, the batch contract:
zero-padded slots per sample, with counts) into the views and crop counts `image_features` takes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from step35.config import Step35Config, VisionConfig
from step35.kernels.masks import DocumentMask
from step35.model.transformer import Step35ForCausalLM

CHANNEL_GROWTH = 4  # the downsamplers' channels, D -> 2D -> 4D: the projector's input is 4D wide


def feature_grid(grid: int) -> int:
    """Features along one side of a view of `grid` patches along it: each stride-2 downsampler halves, rounding up."""
    half = -(-grid // 2)
    return -(-half // 2)


# --------------------------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class ViewGroup:
    """`count` views of `grid_h` x `grid_w` patches; their tokens are rows start..start + count * grid_h * grid_w
    of the packed tokens."""

    count: int
    grid_h: int
    grid_w: int
    start: int

    @property
    def tokens_per_view(self) -> int:
        return self.grid_h * self.grid_w

    @property
    def stop(self) -> int:
        return self.start + self.count * self.tokens_per_view


def view_groups(groups: Sequence[torch.Tensor], patch_size: int, channels: int) -> list[ViewGroup]:
    """The packed layout of `groups` ([n_k, C, H_k, W_k] each); ValueError naming a group of another shape."""
    if len(groups) == 0:
        raise ValueError("VisionEncoder.forward: no group of views given (pass an empty [0, C, H, W] tensor for none)")
    out, start = [], 0
    for k, pixels in enumerate(groups):
        if pixels.dim() != 4 or pixels.shape[1] != channels or min(pixels.shape[2:]) < patch_size:
            raise ValueError(
                f"VisionEncoder.forward: pixel group {k} has shape {tuple(pixels.shape)}; expected "
                f"[views, {channels}, height, width] with sides of at least patch_size {patch_size}"
            )
        group = ViewGroup(pixels.shape[0], pixels.shape[2] // patch_size, pixels.shape[3] // patch_size, start)
        out.append(group)
        start = group.stop
    return out


def patches_of(pixels: torch.Tensor, patch_size: int) -> torch.Tensor:
    """[n, C, H, W] -> [n * gh * gw, C, p, p]: each view's patches, row by row (a side's remainder is dropped, as
    a stride-p convolution drops it)."""
    n, c, height, width = pixels.shape
    gh, gw = height // patch_size, width // patch_size
    pixels = pixels[:, :, : gh * patch_size, : gw * patch_size]
    grid = pixels.reshape(n, c, gh, patch_size, gw, patch_size).permute(0, 2, 4, 1, 3, 5)
    return grid.reshape(n * gh * gw, c, patch_size, patch_size)


def rotary_angles(grid_h: int, grid_w: int, head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """[gh * gw, head_dim / 2] fp32: the angle of each rotated pair of each token (column axis, then row axis)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim // 2, 2, dtype=torch.float32, device=device) / (head_dim // 2))
    rows = torch.arange(grid_h, device=device).repeat_interleave(grid_w).float()
    cols = torch.arange(grid_w, device=device).repeat(grid_h).float()
    return torch.cat([cols[:, None] * inv_freq, rows[:, None] * inv_freq], dim=-1)


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, hd] with dims (2p, 2p+1) turned by the angle whose cos, sin [T, hd / 2] are given; in fp32."""
    pairs = x.float().unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    turned = torch.stack([x0 * cos - x1 * sin, x1 * cos + x0 * sin], dim=-1)
    return turned.flatten(-2).to(x.dtype)


# --------------------------------------------------------------------------------------------- blocks
class LayerScale(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.hidden_size, config.intermediate_size)
        self.c_proj = nn.Linear(config.intermediate_size, config.hidden_size)
        self.quick = config.hidden_act == "quick_gelu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.c_fc(x)
        x = x * torch.sigmoid(1.702 * x) if self.quick else F.gelu(x)
        return self.c_proj(x)


class VisionAttention(nn.Module):
    """Bidirectional multi-head attention within each view, 2-D rotary q and k; fused q, k, v projection."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        D = config.hidden_size
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.in_proj_weight = nn.Parameter(torch.empty(3 * D, D))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * D))
        self.out_proj = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, groups: list[ViewGroup], rope: list[tuple[torch.Tensor, torch.Tensor]]):
        """x [P, D], all views' tokens packed -> [P, D]."""
        qkv = F.linear(x, self.in_proj_weight, self.in_proj_bias)
        outs = []
        for group, (cos, sin) in zip(groups, rope):
            n, T = group.count, group.tokens_per_view
            part = qkv[group.start : group.stop].reshape(n, T, 3, self.num_heads, self.head_dim)
            q, k, v = part.permute(2, 0, 3, 1, 4)  # each [n, heads, T, hd]
            o = F.scaled_dot_product_attention(rotate_pairs(q, cos, sin), rotate_pairs(k, cos, sin), v)
            outs.append(o.transpose(1, 2).reshape(n * T, x.shape[-1]))
        return self.out_proj(torch.cat(outs))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        D, eps = config.hidden_size, config.layer_norm_eps
        self.ln_1 = nn.LayerNorm(D, eps=eps)
        self.attn = VisionAttention(config)
        self.ls_1 = LayerScale(D)
        self.ln_2 = nn.LayerNorm(D, eps=eps)
        self.mlp = VisionMLP(config)
        self.ls_2 = LayerScale(D)

    def forward(self, h: torch.Tensor, groups: list[ViewGroup], rope: list) -> torch.Tensor:
        h = h + self.ls_1(self.attn(self.ln_1(h), groups, rope))
        return h + self.ls_2(self.mlp(self.ln_2(h)))


class VisionTransformer(nn.Module):
    """The blocks (`transformer.resblocks.{i}`), each called once on every view's tokens."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.resblocks = nn.ModuleList(VisionBlock(config) for _ in range(config.num_hidden_layers))

    def forward(self, h: torch.Tensor, groups: list[ViewGroup], rope: list) -> torch.Tensor:
        for block in self.resblocks:
            h = block(h, groups, rope)
        return h


# --------------------------------------------------------------------------------------------- encoder
class VisionEncoder(nn.Module):
    """`vision_model.*`: groups of views [n_k, 3, H_k, W_k] -> per group [n_k, T_k, 4D] (before the projector)."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        D, p = config.hidden_size, config.patch_size
        self.config = config
        self.conv1 = nn.Conv2d(config.num_channels, D, kernel_size=p, stride=p, bias=False)
        self.positional_embedding = nn.Parameter(torch.empty((config.image_size // p) ** 2, D))
        self.ln_pre = nn.LayerNorm(D, eps=config.layer_norm_eps)
        self.transformer = VisionTransformer(config)
        self.vit_downsampler1 = nn.Conv2d(D, 2 * D, kernel_size=3, stride=2, padding=1)
        self.vit_downsampler2 = nn.Conv2d(2 * D, 4 * D, kernel_size=3, stride=2, padding=1)

    def forward(self, groups: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        config = self.config
        layout = view_groups(groups, config.patch_size, config.num_channels)
        dtype = self.conv1.weight.dtype
        patches = torch.cat([patches_of(g.to(dtype), config.patch_size) for g in groups])
        h = self.conv1(patches).flatten(1)  # [P, D]
        positions = [self.positions(g.grid_h, g.grid_w).repeat(g.count, 1) for g in layout]
        h = self.ln_pre(h + torch.cat(positions))
        rope = []
        for g in layout:
            angles = rotary_angles(g.grid_h, g.grid_w, config.head_dim, config.rope_theta, h.device)
            rope.append((angles.cos(), angles.sin()))
        h = self.transformer(h, layout, rope)
        return self.downsample(h, layout)

    def positions(self, grid_h: int, grid_w: int) -> torch.Tensor:
        """[gh * gw, D]: the position table, resized bilinearly (corners not aligned) to a grid of another size."""
        table = self.positional_embedding
        side = round(table.shape[0] ** 0.5)
        if (grid_h, grid_w) == (side, side):
            return table
        square = table.reshape(1, side, side, -1).permute(0, 3, 1, 2)
        resized = F.interpolate(square, size=(grid_h, grid_w), mode="bilinear", align_corners=False)
        return resized.permute(0, 2, 3, 1).reshape(grid_h * grid_w, -1)

    def downsample(self, h: torch.Tensor, layout: list[ViewGroup]) -> list[torch.Tensor]:
        """Packed tokens [P, D] -> per group [n, T, 4D], both convolutions called once on a zero-padded canvas."""
        height, width = max(g.grid_h for g in layout), max(g.grid_w for g in layout)
        canvas, inside = [], []
        for g in layout:
            views = h[g.start : g.stop].reshape(g.count, g.grid_h, g.grid_w, h.shape[-1]).permute(0, 3, 1, 2)
            canvas.append(F.pad(views, (0, width - g.grid_w, 0, height - g.grid_h)))
            half = torch.ones(g.count, 1, -(-g.grid_h // 2), -(-g.grid_w // 2), dtype=h.dtype, device=h.device)
            inside.append(F.pad(half, (0, -(-width // 2) - half.shape[3], 0, -(-height // 2) - half.shape[2])))
        x = self.vit_downsampler1(torch.cat(canvas))
        x = self.vit_downsampler2(x * torch.cat(inside))  # outside a view: zeros, as its own padding would be
        out, first = [], 0
        for g in layout:
            fh, fw = feature_grid(g.grid_h), feature_grid(g.grid_w)
            out.append(x[first : first + g.count, :, :fh, :fw].flatten(2).transpose(1, 2))
            first += g.count
        return out


def vision_projector(config: VisionConfig, text_hidden_size: int) -> nn.Linear:
    """`vit_large_projector`: the encoder's 4D-wide features -> the language model's hidden size."""
    return nn.Linear(CHANNEL_GROWTH * config.hidden_size, text_hidden_size, bias=config.projector_bias)


def encode_views(encoder: VisionEncoder, projector: nn.Linear, groups: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Groups of views -> per group [n_k, T_k, H_text]; the encoder and the projector each called once."""
    encoded = encoder(groups)
    projected = projector(torch.cat([e.flatten(0, 1) for e in encoded])).split(
        [e.shape[0] * e.shape[1] for e in encoded]
    )
    return [p.reshape(e.shape[0], e.shape[1], projector.out_features) for p, e in zip(projected, encoded)]


class VisionTower(nn.Module):
    """The encoder and the projector, named as in the release from the VLM's root (`vision_model.*`,
    `vit_large_projector.*`)."""

    def __init__(self, config: VisionConfig, text_hidden_size: int):
        super().__init__()
        self.vision_model = VisionEncoder(config)
        self.vit_large_projector = vision_projector(config, text_hidden_size)

    def forward(self, pixel_values: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor | list[torch.Tensor]:
        """pixel_values [N, 3, H, W] -> features [N, T, H_text]; or groups of views of one size each (e.g. the
        global views [G, 3, 728, 728] and the crops [C, 3, 504, 504]) -> a list of [n_k, T_k, H_text], all views
        computed in one call of each module."""
        if isinstance(pixel_values, torch.Tensor):
            return encode_views(self.vision_model, self.vit_large_projector, [pixel_values])[0]
        return encode_views(self.vision_model, self.vit_large_projector, pixel_values)


# --------------------------------------------------------------------------------------------- splice
def splice_image_features(
    input_embeds: torch.Tensor, input_ids: torch.Tensor, image_token_id: int, features: torch.Tensor
) -> torch.Tensor:
    """input_embeds [B, S, H] with the embeddings of the image placeholder tokens (input_ids [B, S] equal to
    `image_token_id`) replaced, in order (row by row), by the rows of features [M, H]. ValueError when the number
    of placeholders is not M."""
    mask = input_ids == image_token_id
    placeholders = int(mask.sum())
    if placeholders != features.shape[0] or features.shape[-1] != input_embeds.shape[-1]:
        raise ValueError(
            f"splice_image_features: input_ids hold {placeholders} image placeholder tokens (id {image_token_id}) "
            f"but the images give {features.shape[0]} feature rows of width {features.shape[-1]} (the embeddings' "
            f"is {input_embeds.shape[-1]}); each image needs as many placeholders as it has features"
        )
    return input_embeds.masked_scatter(mask.unsqueeze(-1), features.to(input_embeds.dtype))


def in_placeholder_order(
    global_features: torch.Tensor, crop_features: torch.Tensor | None, num_crops: Sequence[int] | torch.Tensor
) -> torch.Tensor:
    """Per image i: its crops' features, then its global view's -> [M, H] (transformers' Step3p7 order).
    global_features [G, T, H] (one view per image), crop_features [C, Tc, H] (C = sum of num_crops) or None."""
    num_crops = [int(n) for n in num_crops]
    C = 0 if crop_features is None else crop_features.shape[0]
    if len(num_crops) != global_features.shape[0] or sum(num_crops) != C:
        raise ValueError(
            f"num_local_patches {num_crops}: {len(num_crops)} images with {sum(num_crops)} crops, but there are "
            f"{global_features.shape[0]} global views and {C} crops"
        )
    pieces, first = [], 0
    for i, n in enumerate(num_crops):
        if n:
            pieces.append(crop_features[first : first + n].flatten(0, 1))
        pieces.append(global_features[i])
        first += n
    return torch.cat(pieces) if pieces else global_features.reshape(0, global_features.shape[-1])


def images_of_batch(
    pixel_values: torch.Tensor,
    pixel_values_local: torch.Tensor,
    num_local_patches: torch.Tensor,
    num_images: torch.Tensor,
) -> dict:
    """The batch contract's padded tensors (pixel_values [B, I, 3, H, W], pixel_values_local [B, K, 3, h, w],
    num_local_patches [B, I], num_images [B]: slots past a sample's count are padding) -> image_features' inputs:
    the samples' global views [G, 3, H, W] and crops [C, 3, h, w] in order, and the crops of each image (G of them).
    One host sync (the counts)."""
    counts, crops = num_images.tolist(), num_local_patches.tolist()
    if len(counts) != pixel_values.shape[0] or any(n > pixel_values.shape[1] for n in counts):
        raise ValueError(f"images_of_batch: num_images {counts} for pixel_values of shape {tuple(pixel_values.shape)}")
    per_image = [c for row, n in zip(crops, counts) for c in row[:n]]
    local = [pixel_values_local[b, : sum(row[:n])] for b, (row, n) in enumerate(zip(crops, counts))]
    return {
        "pixel_values": torch.cat([pixel_values[b, :n] for b, n in enumerate(counts)]),
        "pixel_values_local": torch.cat(local),
        "num_local_patches": per_image,
    }


# --------------------------------------------------------------------------------------------- the VLM
class Step35VLForConditionalGeneration(Step35ForCausalLM):
    """Step35ForCausalLM (`model.*`, `lm_head.*`) with Step-3.7's encoder (`vision_model.*`) and projector
    (`vit_large_projector.*`): a Step-3.7-Flash folder's whole state."""

    def __init__(self, config: Step35Config, vision: VisionConfig, num_mtp_layers: int | None = None):
        super().__init__(config, num_mtp_layers)
        self.vision_config = vision
        self.vision_model = VisionEncoder(vision)
        self.vit_large_projector = vision_projector(vision, config.hidden_size)

    def image_features(
        self,
        pixel_values: torch.Tensor | None,
        pixel_values_local: torch.Tensor | None = None,
        num_local_patches: Sequence[int] | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[M, H] in placeholder order, from global views [G, 3, H, W], crops [C, 3, h, w] and the crops per image
        (transformers' Step3p7ImageProcessor outputs). Without images ([0, H]) the encoder still runs, on no
        view: every rank calls every vision module once per step."""
        if pixel_values is None:
            side = self.vision_config.image_size
            pixel_values = self.vit_large_projector.weight.new_zeros(0, self.vision_config.num_channels, side, side)
        groups = [pixel_values] if pixel_values_local is None else [pixel_values, pixel_values_local]
        features = encode_views(self.vision_model, self.vit_large_projector, groups)
        crops = features[1] if pixel_values_local is not None else None
        counts = num_local_patches if num_local_patches is not None else [0] * pixel_values.shape[0]
        return in_placeholder_order(features[0], crops, counts)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        *,
        pixel_values: torch.Tensor | None = None,
        pixel_values_local: torch.Tensor | None = None,
        num_local_patches: Sequence[int] | torch.Tensor | None = None,
        image_token_id: int | None = None,
    ) -> torch.Tensor:
        """input_ids [B, S] -> logits [B, S, V], the image placeholder tokens (`image_token_id`, None: the
        config's) embedded as the images' features. position_ids as in Step35ForCausalLM.forward."""
        if position_ids is not None and position_ids.shape != input_ids.shape:
            raise ValueError(f"position_ids has shape {tuple(position_ids.shape)}, input_ids {tuple(input_ids.shape)}")
        token = self.vision_config.image_token_id if image_token_id is None else image_token_id
        features = self.image_features(pixel_values, pixel_values_local, num_local_patches)
        embeds = splice_image_features(self.model.embed_tokens(input_ids), input_ids, token, features)
        documents = DocumentMask(position_ids) if position_ids is not None else None
        rope = self.model.rotary_tables(input_ids.shape[1], input_ids.device, position_ids)
        h = self.model(input_ids, rope, documents=documents, inputs_embeds=embeds)
        return self.lm_head(self.model.norm(h))

    def loss(self, input_ids: torch.Tensor, labels: torch.Tensor, *, images: dict | None = None, **options):
        """Step35ForCausalLM.loss with the images' features spliced into the embeddings of the whole rows first.
        images: image_features' keyword arguments (pixel_values, pixel_values_local, num_local_patches; e.g.
        images_of_batch of a batch); None: no image, yet the encoder and the projector still run once, on no
        view, so that every rank calls every vision module once per micro-batch (FSDP)."""
        return super().loss(input_ids, labels, inputs_embeds=self.embed_with_images(input_ids, images), **options)

    def embed_with_images(self, input_ids: torch.Tensor, images: dict | None = None) -> torch.Tensor:
        """[B, S, H]: input_ids' embeddings with the image placeholders replaced by the features of `images`
        (image_features' keyword arguments; None: no image, the encoder run on no view)."""
        features = self.image_features(**(images or {"pixel_values": None}))
        embeds = self.model.embed_tokens(input_ids)
        return splice_image_features(embeds, input_ids, self.vision_config.image_token_id, features)
