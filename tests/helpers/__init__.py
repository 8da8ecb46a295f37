"""The step35 tests' shared helpers, one module a topic; every name is re-exported here, so a test writes
`from tests.helpers import X` whichever module holds X:

- models: the tiny config every test starts from, randomised tiny models, the hand RoPE frequencies;
- readers: what runs leave (wandb records, TensorBoard events, CSV metrics, checkpoints, HF tensors), compared
  to the bit;
- run_configs: the YAML run configs of the run-folder and chaos tests, the command line of a quick tiny run;
- training: `make_trainer`, the one Trainer builder, and the runs in this process several files share;
- context_parallel: a cp shard simulated in one process;
- tokenizers, data, chat, chat_templates: tokenizers, data files, token streams and records, chat data and
  templates;
- step37: tiny Step-3.7-Flash folders;
- files: a flipped bit, a small filesystem.

Starting step35 (a subprocess, torchrun, a launcher, the CLI in this process) is tests/runner.py's."""
# ruff: noqa: F401  (the names below are imported to be re-exported)

from tests.helpers.chat import CHAT_IDS, CHAT_ROLES, CHAT_WORD_TEMPLATE, CHAT_WORDS, chat_source, make_chat_tokenizer
from tests.helpers.chat_templates import (
    CHATML,
    CONVERSATION,
    SOURCES,
    SPECIAL,
    TOOL_CALLS,
    TOOLS,
    marked,
    plain,
    step_style,
)
from tests.helpers.context_parallel import simulated_shard
from tests.helpers.data import (
    DOC_WORDS,
    RecordAt,
    doc_id,
    make_word_tokenizer,
    resume_matches,
    take,
    worker_stack_on_hang,
    write_jsonl,
)
from tests.helpers.files import flip_byte, small_filesystem
from tests.helpers.models import (
    flash_config_dict,
    hand_inv_freq,
    randomize_,
    state_numel,
    tiny_config,
    tiny_config_dict,
    tiny_model,
)
from tests.helpers.readers import (
    assert_bitwise,
    metric_rows,
    run_losses,
    safetensors_in,
    saved_steps,
    steps_of,
    tensorboard_events,
    wandb_records,
)
from tests.helpers.run_configs import CHAOS_CONFIG, RUN_CONFIG, lora_config, tiny_run_args, write_run_config
from tests.helpers.step37 import BOOKKEEPING, STEP37_VISION, step37_folder, vision_tensors_and_config
from tests.helpers.tokenizers import WORD_EOS, train_byte_bpe, word_tokenizer_folder
from tests.helpers.training import LORA, checkpoint_io, checkpointed_fit, hf_base, lora_fit, make_trainer, one_step_from
