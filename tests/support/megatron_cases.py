"""What the Megatron-LM conversion tests share: the GPT-2 their checkpoints are built from
(tests/support/megatron_layout.py builds them), and the check that a converted model computes its function."""

from __future__ import annotations

import torch
from transformers import GPT2LMHeadModel

from tests.support.megatron_layout import source_gpt2
from tnlg import TNLGForCausalLM

VOCAB, HEADS = 300, 4


def megatron_source_gpt2() -> GPT2LMHeadModel:
    return source_gpt2(VOCAB, width=64, layers=4, heads=HEADS, positions=64)


def assert_same_function(tnlg: TNLGForCausalLM, gpt2: GPT2LMHeadModel) -> None:
    input_ids = torch.randint(0, VOCAB, (2, 24))
    torch.testing.assert_close(tnlg(input_ids).logits, gpt2(input_ids).logits, atol=1e-5, rtol=0)
