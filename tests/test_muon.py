"""`model.optimizer muon` (step35/training/muon.py, single process): torch.optim.Muon's update for a plain
matrix; Newton–Schulz against a float64 one written here from its formula, per logical matrix (q, k, v, g
apart, every expert apart); which parameters Muon takes; its state; resume and sharding refusals; a fit."""

from pathlib import Path

import pytest
import torch

from step35.run import ResumeMismatchError, SavedRun, check_resume
from step35.training.muon import Muon, matrix_role
from step35.training.optimizer import OptimizerOptions, build_optimizer, state_slots_per_group
from step35.training.setup import TrainedModel, training_model
from tests.helpers import tiny_config

# The Polar Express coefficients as printed in arXiv:2505.16932 Algorithm 1, and StepFun's use of them
# (SteptronOss steptronoss/optimizer/_helpers.py): the first seven / (1.01, 1.01^3, 1.01^5), the last repeated,
# the Frobenius norm times 1.01 before the first step.
PAPER = [
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
]


@pytest.fixture(autouse=True)
def one_thread():
    """Small matmuls: on the shared 2-core machine two threads are up to 100x slower than one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def polar_express_steps(n):
    scaled = [(a / 1.01, b / 1.01**3, c / 1.01**5) for a, b, c in PAPER[:-1]] + [PAPER[-1]]
    return [scaled[min(k, len(scaled) - 1)] for k in range(n)]


def ns64(g: torch.Tensor, steps, margin: float) -> torch.Tensor:
    """Newton–Schulz in float64 on ONE matrix: X = G / (margin ||G||_F), X <- a X + b (X X^T) X + c (X X^T)^2 X
    on the wide orientation."""
    x = g.double()
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / (margin * torch.linalg.matrix_norm(x))
    for a, b, c in steps:
        s = x @ x.T
        x = a * x + b * (s @ x) + c * (s @ s @ x)
    return x.T if tall else x


def tiny_model(**kwargs):
    return training_model(TrainedModel(tiny_config(), **kwargs), device="cpu")


def one_step(model, options):
    optimizer = build_optimizer(model, options)
    tokens = torch.randint(0, 1024, (2, 17), generator=torch.Generator().manual_seed(0))
    model.loss(tokens[:, :-1], tokens[:, 1:], mtp_loss_weight=0.3).loss.backward()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    optimizer.step()
    return optimizer, before, grads


@pytest.mark.parametrize("shape", [(24, 40), (40, 24)])
def test_a_plain_matrix_takes_torch_muons_update(shape):
    """Classic coefficients, lr_adjust original, nesterov, weight decay: 3 steps equal torch.optim.Muon's
    within 1e-6 relative. torch runs NS in bf16 whatever the device, so ns_dtype bfloat16 here (in fp32,
    step35's CPU default, the update differs from torch's by bf16 rounding, about 1e-2)."""
    gen = torch.Generator().manual_seed(1)
    w0 = torch.randn(*shape, generator=gen)
    ours, theirs = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    mine = Muon(
        [{"params": [ours], "use_muon": True}],
        lr=0.02,
        weight_decay=0.1,
        coefficients="classic",
        lr_adjust="original",
        ns_dtype="bfloat16",
    )
    reference = torch.optim.Muon([theirs], lr=0.02, weight_decay=0.1, adjust_lr_fn="original")
    for _ in range(3):
        grad = torch.randn(*shape, generator=gen)
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        mine.step()
        reference.step()
    moved = (theirs - w0).norm()
    assert moved > 0.01
    assert (ours - theirs).norm() / moved <= 1e-6
    assert (ours - theirs).norm() / theirs.norm() <= 1e-6


def test_polar_express_is_the_float64_newton_schulz_of_the_paper_coefficients():
    """One step from zero momentum: the update is -lr * 0.2 sqrt(max(A, B)) * NS(G) (nesterov momentum of a
    first step is a multiple of G, which NS's normalisation removes) and W's decay; NS in fp32 within 2e-4
    of the float64 NS with 6 polar-express steps; classic coefficients would be far off."""
    gen = torch.Generator().manual_seed(2)
    w0, grad = torch.randn(48, 32, generator=gen), torch.randn(48, 32, generator=gen)
    param = torch.nn.Parameter(w0.clone())
    optimizer = Muon(
        [{"params": [param], "use_muon": True}],
        lr=0.01,
        weight_decay=0.1,
        ns_steps=6,
        coefficients="polar_express",
        lr_adjust="match_rms_adamw",
        ns_dtype="float32",
    )
    param.grad = grad
    optimizer.step()
    ortho = -(param.detach().double() - w0.double() * (1 - 0.01 * 0.1)) / (0.01 * 0.2 * 48**0.5)
    expected = ns64(grad, polar_express_steps(6), margin=1.01)
    assert (ortho - expected).norm() / expected.norm() < 2e-4
    classic = ns64(grad, [(3.4445, -4.7750, 2.0315)] * 6, margin=1.0)
    assert (classic - expected).norm() / expected.norm() > 1e-2  # the check above can tell the coefficient sets apart
    singular = torch.linalg.svdvals(expected)
    assert 0.6 < singular.min() and singular.max() < 1.3  # about orthogonal: what Muon is for


def test_each_logical_matrix_is_orthogonalised_on_its_own():
    """On the tiny model with MTP and every expert: after one step every Muon parameter moved by its own
    float64 NS per logical matrix (q, k, v, g, o, share_expert apart; each of the E experts of gate/up/down
    apart) within 2e-4; NS of the stacked experts as one [E*out, in] matrix, or of q|k|v|g as one, is far off."""
    model = tiny_model(num_mtp_layers=1, mtp_loss_weight=0.3)
    lr, wd = 0.01, 0.1
    options = OptimizerOptions(
        name="muon", lr=lr, weight_decay=wd, extra={"coefficients": "polar_express", "ns_steps": 5}
    )
    optimizer, before, grads = one_step(model, options)
    after = dict(model.named_parameters())
    steps, checked, experts = polar_express_steps(5), 0, 0
    muon_names = [n for n, p in model.named_parameters() if matrix_role(n, tuple(p.shape)).optimizer == "muon"]
    assert {id(after[n]) for n in muon_names} == {id(p) for p in optimizer.param_groups[0]["params"]}
    for name in muon_names:
        ortho = -(after[name].detach().double() - before[name].double() * (1 - lr * wd))
        g = grads[name]
        mats = g.reshape(-1, *g.shape[-2:])
        for e, (o, m) in enumerate(zip(ortho.reshape(-1, *g.shape[-2:]), mats)):
            rows, cols = m.shape
            expected = lr * 0.2 * max(rows, cols) ** 0.5 * ns64(m, steps, 1.01)
            assert (o - expected).norm() / expected.norm() < 2e-4, (name, e)
        checked += 1
        if g.dim() == 3:
            experts += 1
            as_one = (
                lr
                * 0.2
                * max(g.shape[0] * g.shape[1], g.shape[2]) ** 0.5
                * ns64(g.reshape(-1, g.shape[-1]), steps, 1.01)
            )
            assert (ortho.reshape(as_one.shape) - as_one).norm() / as_one.norm() > 1e-2, name
    assert experts == 4 * 3 and checked == len(optimizer.param_groups[0]["params"]) > 40
    layer = "model.layers.0.self_attn."
    fused = torch.cat([grads[layer + f"{p}_proj.weight"] for p in "qkvg"])
    fused_ns = ns64(fused, steps, 1.01)
    own = torch.cat([ns64(grads[layer + f"{p}_proj.weight"], steps, 1.01) for p in "qkvg"])
    assert (fused_ns - own).norm() / own.norm() > 1e-2


def test_a_fused_parameter_declares_its_row_splits():
    """A fused [q; k; v; g] parameter with row_splits takes exactly the updates of the four apart."""
    gen = torch.Generator().manual_seed(3)
    sizes = [32, 16, 16, 4]
    parts = [torch.nn.Parameter(torch.randn(n, 24, generator=gen)) for n in sizes]
    fused = torch.nn.Parameter(torch.cat([p.detach() for p in parts]))
    grads = [torch.randn(n, 24, generator=gen) for n in sizes]
    settings = {"use_muon": True, "lr_adjust": "original", "ns_dtype": "float32"}
    apart = Muon([{"params": parts, **settings}], lr=0.02)
    together = Muon([{"params": [fused], "row_splits": [sizes], **settings}], lr=0.02)
    for p, g in zip(parts, grads):
        p.grad = g
    fused.grad = torch.cat(grads)
    apart.step()
    together.step()
    assert torch.equal(fused.detach(), torch.cat([p.detach() for p in parts]))
    whole = Muon([{"params": [w := torch.nn.Parameter(torch.cat([p.detach() for p in parts]))], **settings}], lr=0.02)
    w.grad = torch.cat(grads)
    whole.step()
    assert not torch.allclose(w, fused, atol=1e-4)


def test_which_parameters_muon_takes():
    """Matrices (attention, dense and shared MLP, experts per expert, eh_proj, LoRA A/B per adapter and per
    expert) to Muon; embeddings, heads, router weight and bias, norms to AdamW."""
    assert matrix_role("model.layers.3.self_attn.q_proj.weight", (12288, 4096)) == ("muon", 1, (12288, 4096))
    assert matrix_role("model.layers.3.moe.down_proj.weight", (288, 4096, 1280)) == ("muon", 288, (4096, 1280))
    assert matrix_role("model.layers.45.eh_proj.weight", (4096, 8192)) == ("muon", 1, (4096, 8192))
    assert matrix_role("model.layers.3.moe.up_proj.lora_A", (288, 4096, 16)) == ("muon", 288, (4096, 16))
    assert matrix_role("model.layers.0.mlp.gate_proj.lora_B", (11264, 16)) == ("muon", 1, (11264, 16))
    for name, shape in [
        ("model.embed_tokens.weight", (128896, 4096)),
        ("lm_head.weight", (128896, 4096)),
        ("model.layers.45.transformer.shared_head.output.weight", (128896, 4096)),
        ("model.layers.3.moe.gate.weight", (288, 4096)),
        ("model.layers.3.moe.gate.lora_A", (16, 4096)),
        ("model.layers.3.moe.router_bias", (288,)),
        ("model.layers.3.self_attn.q_norm.weight", (128,)),
        ("model.norm.weight", (4096,)),
    ]:
        assert matrix_role(name, shape).optimizer == "adamw", name
    lora = {"rank": 4, "targets": ["attention", "mlp", "shared_expert", "experts", "router", "lm_head"]}
    from step35.model.lora import LoraConfig

    model = tiny_model(lora=LoraConfig.of(lora))
    optimizer = build_optimizer(model, OptimizerOptions(name="muon"))
    names = {id(p): n for n, p in model.named_parameters()}
    muon = sorted(names[id(p)] for p in optimizer.param_groups[0]["params"])
    assert muon and all(n.endswith(("lora_A", "lora_B")) and ".moe.gate." not in n for n in muon)
    tokens = torch.randint(0, 1024, (2, 17), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(3):  # B starts at 0, so A's first gradient is 0: NS of a zero matrix must stay 0, not NaN
        optimizer.zero_grad()
        losses.append(model.loss(tokens[:, :-1], tokens[:, 1:]).loss)
        losses[-1].backward()
        optimizer.step()
    assert all(torch.isfinite(p).all() for p in model.parameters()) and losses[2] < losses[0]
    assert any(".moe.up_proj.lora_A" in n for n in muon) and any(
        "lm_head" in names[id(p)] for p in optimizer.param_groups[1]["params"]
    )


def test_state_one_fp32_momentum_per_muon_param_and_adamws_two_for_the_rest():
    model = tiny_model()
    options = OptimizerOptions(name="muon", lr=1e-3)
    optimizer, _, _ = one_step(model, options)
    muon, decay, no_decay = optimizer.param_groups
    assert (muon["name"], decay["name"], no_decay["name"]) == ("muon", "decay", "no_decay")
    assert no_decay["weight_decay"] == 0.0 and decay["betas"] == (0.9, 0.95)
    for p in muon["params"]:
        state = optimizer.state[p]
        assert list(state) == ["momentum_buffer"] and state["momentum_buffer"].dtype == torch.float32
    for p in decay["params"] + no_decay["params"]:
        assert sorted(k for k, v in optimizer.state[p].items() if v.shape == p.shape) == ["exp_avg", "exp_avg_sq"]
    assert state_slots_per_group(options) == [1, 2, 2]
    stepfun = OptimizerOptions(name="muon", extra={"preset": "stepfun"}).group_settings()
    assert (
        stepfun[0]["ns_steps"] == 6
        and stepfun[0]["coefficients"] == "polar_express"
        and stepfun[1]["betas"] == (0.95, 0.95)
    )


def test_the_adamw_part_is_torchs_adamw_bit_for_bit():
    gen = torch.Generator().manual_seed(4)
    w0 = torch.randn(8, 5, generator=gen)
    a, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    mine = Muon([{"params": [a]}], lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    theirs = torch.optim.AdamW([b], lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    for _ in range(3):
        g = torch.randn(8, 5, generator=gen)
        a.grad, b.grad = g.clone(), g.clone()
        mine.step()
        theirs.step()
    assert torch.equal(a, b) and not torch.equal(a, w0)


@pytest.mark.parametrize(
    "extra,message",
    [
        ({"coefficients": "quintic"}, "model.optimizer_options.coefficients='quintic': must be one of"),
        ({"lr_adjust": "none"}, "model.optimizer_options.lr_adjust='none': must be one of"),
        ({"ns_steps": 0}, "model.optimizer_options.ns_steps=0: must be an integer in [1, 99]"),
        ({"momentun": 0.9}, "['momentun'] are not options of model.optimizer muon"),
        ({"preset": "moonlight"}, "model.optimizer_options.preset='moonlight': must be one of ['stepfun']"),
    ],
)
def test_bad_muon_options_are_refused_naming_them(extra, message):
    from step35.module import Step35LightningModule

    with pytest.raises(ValueError) as err:
        Step35LightningModule(config="tiny", optimizer="muon", optimizer_options=extra)
    assert message in str(err.value)


def test_a_resume_with_another_optimizer_is_refused():
    config = tiny_config()
    saved = SavedRun(Path("last.ckpt"), {"optimizer": "adamw", "lr": 3e-4}, config.to_dict())
    with pytest.raises(ResumeMismatchError, match=r"model.optimizer: adamw -> muon.*resume with model.optimizer=adamw"):
        check_resume(saved, config, {"optimizer": "muon", "lr": 3e-4})
    saved = SavedRun(Path("last.ckpt"), {"optimizer": "muon", "lr": 3e-4}, config.to_dict())
    with pytest.raises(ResumeMismatchError, match=r"model.optimizer: muon -> adamw"):
        check_resume(saved, config, {"optimizer": "adamw", "lr": 3e-4})


def test_a_one_rank_dtensor_takes_the_plain_update_and_a_partial_one_is_refused(tmp_path):
    """A DTensor matrix (as FSDP2 / EP leave them) on a one-rank mesh takes the plain tensor's update (nothing to
    exchange); a placement that is no slice of rows or columns (Partial) is refused, naming the parameter.
    (2 and 4 ranks, EP 1/2/4 and HSDP: tests/test_distributed_equivalence.py's muon cases.)"""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        torch.manual_seed(0)
        weight, grad = torch.randn(6, 4), torch.randn(6, 4)
        sharded = torch.nn.Parameter(distribute_tensor(weight.clone(), mesh, [Shard(0)]))
        plain = torch.nn.Parameter(weight.clone())
        for param in (sharded, plain):
            optimizer = Muon([{"params": [param], "use_muon": True}], lr=0.1, coefficients="polar_express")
            param.grad = distribute_tensor(grad, mesh, [Shard(0)]) if param is sharded else grad.clone()
            optimizer.step()
        assert torch.equal(sharded.full_tensor(), plain.detach())
        partial = torch.nn.Parameter(DTensor.from_local(torch.randn(4, 4), mesh, [Partial()]))
        with pytest.raises(
            ValueError, match=r"param 0 of group 'matrices' \(4, 4\): placement Partial\(sum\) .*not a plain Shard"
        ):
            Muon([{"params": [partial], "use_muon": True, "name": "matrices"}])
    finally:
        dist.destroy_process_group()


def test_chunk_sizes_are_torch_chunks():
    from step35.parallel.whole_matrices import chunk_sizes

    for n in range(0, 13):
        for k in range(1, 6):
            assert chunk_sizes(n, k)[: len(torch.arange(n).chunk(k))] == [len(c) for c in torch.arange(n).chunk(k)]
            assert sum(chunk_sizes(n, k)) == n and len(chunk_sizes(n, k)) == k


def test_a_tiny_fit_with_muon_lowers_the_loss(tmp_path, builtin_cache, capfd):
    """`step35 fit --model.optimizer muon` on the tiny run config (MTP trained too): 5 steps, the loss falls."""
    from tests.helpers import run_losses, write_run_config
    from tests.runner import cli_fit

    config = write_run_config(tmp_path)
    cli_fit(capfd, config, tmp_path / "run", builtin_cache, "--model.optimizer=muon", "--trainer.max_steps=5")
    losses = run_losses(tmp_path / "run")
    assert sorted(losses) == list(range(5)), losses
    assert losses[4] < losses[0] - 0.1, losses


@pytest.mark.heavy
def test_a_resumed_muon_run_continues_bit_for_bit(tmp_path, builtin_cache, capfd):
    """Stopped at step 5 (its checkpoint holds the momentum buffers and the AdamW moments) and resumed with
    `--ckpt_path last`, a muon run logs the losses of the run that went through, bit for bit."""
    from tests.helpers import RUN_CONFIG, run_losses, write_run_config
    from tests.runner import cli_fit

    text = "  decay_steps: 10\n  optimizer: muon\n  optimizer_options:\n    preset: stepfun\n  mtp_loss_weight: 0.3\n"
    assert "  mtp_loss_weight: 0.3\n" in RUN_CONFIG
    config = write_run_config(tmp_path, RUN_CONFIG.replace("  mtp_loss_weight: 0.3\n", text))
    cli_fit(capfd, config, tmp_path / "through", builtin_cache)
    cli_fit(capfd, config, tmp_path / "cut", builtin_cache, "--trainer.max_steps=5")
    cli_fit(capfd, config, tmp_path / "cut", builtin_cache, "--ckpt_path=last")
    through, resumed = run_losses(tmp_path / "through"), run_losses(tmp_path / "cut")
    assert sorted(through) == sorted(resumed) == list(range(10)), (through, resumed)
    assert [resumed[s] for s in range(5, 10)] == [through[s] for s in range(5, 10)]
    assert through[9] < through[0]
