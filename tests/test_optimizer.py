"""The optimizer room (step35/training/optimizer.py): `model.optimizer` chooses AdamW or any
torch.optim.Optimizer by class path; the state it keeps per parameter is asked of the optimizer (and
the plan counts that); bad choices are refused naming the option; a resume refuses another optimizer."""

from pathlib import Path

import pytest
import torch

from step35.module import Step35LightningModule
from step35.run import ResumeMismatchError, SavedRun, check_resume
from step35.training.optimizer import OptimizerOptions, build_optimizer, state_slots
from step35.training.setup import TrainedModel, training_model
from tests.helpers import tiny_config

ROOT = Path(__file__).parent.parent
pytestmark = pytest.mark.quick


def tiny_model():
    return training_model(TrainedModel(tiny_config()), device="cpu")


def test_adamw_is_the_default_with_two_groups_and_no_decay_on_norms():
    model = tiny_model()
    optimizer = build_optimizer(model, OptimizerOptions(lr=1e-3, weight_decay=0.05, betas=(0.8, 0.9), eps=1e-6))
    assert type(optimizer) is torch.optim.AdamW
    decay, no_decay = optimizer.param_groups
    assert (decay["name"], decay["weight_decay"], no_decay["name"], no_decay["weight_decay"]) == (
        "decay",
        0.05,
        "no_decay",
        0.0,
    )
    assert decay["betas"] == (0.8, 0.9) and decay["eps"] == 1e-6 and decay["lr"] == 1e-3
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(names[id(p)].endswith("norm.weight") for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == sum(1 for p in model.parameters() if p.requires_grad)


def test_a_class_path_optimizer_steps_like_torch_itself():
    """SGD with momentum and weight decay by class path: two steps of the room's optimizer on the tiny
    model equal two steps of torch.optim.SGD built by hand on a copy (same groups), bit for bit."""
    options = OptimizerOptions(name="torch.optim.SGD", lr=0.05, weight_decay=0.01, extra={"momentum": 0.9})
    model, reference = tiny_model(), tiny_model()
    reference.load_state_dict(model.state_dict())
    optimizer = build_optimizer(model, options)
    assert type(optimizer) is torch.optim.SGD and optimizer.param_groups[0]["momentum"] == 0.9
    by_hand = torch.optim.SGD(
        [
            {
                "params": [
                    p for n, p in reference.named_parameters() if p.requires_grad and not n.endswith("norm.weight")
                ],
                "weight_decay": 0.01,
            },
            {
                "params": [p for n, p in reference.named_parameters() if p.requires_grad and n.endswith("norm.weight")],
                "weight_decay": 0.0,
            },
        ],
        lr=0.05,
        momentum=0.9,
    )
    tokens = torch.randint(0, 1024, (2, 17), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        for m, opt in ((model, optimizer), (reference, by_hand)):
            opt.zero_grad()
            m.loss(tokens[:, :-1], tokens[:, 1:]).loss.backward()
            opt.step()
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(a, b), name
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), tiny_model().parameters()))


@pytest.mark.parametrize(
    "options,slots",
    [
        (OptimizerOptions(), 2),  # exp_avg, exp_avg_sq
        (OptimizerOptions(extra={"amsgrad": True}), 3),  # + max_exp_avg_sq
        (OptimizerOptions(name="torch.optim.SGD", extra={"momentum": 0.9}), 1),
        (OptimizerOptions(name="torch.optim.SGD"), 0),
        (OptimizerOptions(name="torch.optim.Adagrad"), 1),
    ],
)
def test_state_slots_are_asked_of_the_optimizer(options, slots):
    assert state_slots(options) == slots


def test_the_plan_counts_the_state_of_the_chosen_optimizer():
    from step35.plan.planner import sharded_state
    from step35.plan.settings import read_settings

    base = ["--config", str(ROOT / "configs" / "tiny.yaml")]
    adamw = sharded_state(read_settings(base)).state
    sgd = sharded_state(
        read_settings([*base, "--model.optimizer", "torch.optim.SGD", "--model.optimizer_options", "{momentum: 0.9}"])
    ).state
    assert adamw.optimizer == 2 * adamw.grads and sgd.optimizer == sgd.grads > 0


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"optimizer": "adam"}, "model.optimizer='adam': not one of adamw, muon, nor a class path"),
        ({"optimizer": "torch.optim.NoSuch"}, "model.optimizer='torch.optim.NoSuch': cannot import it"),
        ({"optimizer": "torch.nn.Linear"}, "model.optimizer='torch.nn.Linear' is not a torch.optim.Optimizer subclass"),
        (
            {"optimizer": "torch.optim.Rprop"},
            "model.optimizer=torch.optim.Rprop has no weight_decay, but model.weight_decay=0.1",
        ),
        (
            {"optimizer_options": {"momentum": 0.9}},
            "model.optimizer_options={'momentum': 0.9}: ['momentum'] are not options of AdamW",
        ),
        ({"lr": -1.0}, "model.lr=-1.0: must be >= 0"),
        ({"betas": (0.9, 1.0)}, "model.betas=[0.9, 1.0]: must be two numbers in [0, 1)"),
    ],
)
def test_bad_optimizer_options_are_refused_naming_the_option(kwargs, message):
    with pytest.raises(ValueError) as err:
        Step35LightningModule(config="tiny", **kwargs)
    assert message in str(err.value)


def test_bad_options_of_a_class_path_are_refused_when_it_is_built():
    module = Step35LightningModule(config="tiny", optimizer="torch.optim.SGD", optimizer_options={"momentun": 0.9})
    with pytest.raises(ValueError, match=r"model.optimizer=torch.optim.SGD with model.optimizer_options=.*momentun"):
        build_optimizer(tiny_model(), module.optimization)


def test_a_resume_refuses_another_optimizer_and_reports_its_options():
    config = tiny_config()
    saved = SavedRun(Path("last.ckpt"), {"optimizer": "adamw", "lr": 3e-4}, config.to_dict())
    with pytest.raises(ResumeMismatchError, match=r"model.optimizer: adamw -> torch.optim.SGD.*model.optimizer=adamw"):
        check_resume(saved, config, {"optimizer": "torch.optim.SGD", "lr": 3e-4})
    old = SavedRun(Path("old.ckpt"), {"lr": 3e-4}, config.to_dict())  # written before model.optimizer existed
    notes = check_resume(old, config, {"optimizer": "adamw", "lr": 1e-4, "optimizer_options": {"amsgrad": True}})
    assert notes == ["lr: 0.0003 -> 0.0001"]
