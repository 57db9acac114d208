"""Generation: next-token logits agree with the training loss; greedy, top-k and sampling."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers.layout_cases import VOCAB, tiny_config
from ptdp.commands.generate import generate, next_token_logits
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.stage import build_stage


@pytest.fixture(scope="module")
def model():
    return build_stage(tiny_config(1, 1, 1, "float64"), ParallelGroups.single_process()).model.eval()


def test_next_token_logits_give_the_training_loss(model):
    data = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    tokens, labels = data[:, :-1], data[:, 1:]
    with torch.no_grad():
        expected = model(tokens, labels)
    per_position = [
        F.cross_entropy(next_token_logits(model, tokens[:, : i + 1]).double(), labels[:, i], reduction="none")
        for i in range(tokens.shape[1])
    ]
    torch.testing.assert_close(torch.stack(per_position).mean().double(), expected.double(), rtol=1e-6, atol=1e-6)


def test_greedy_top_k_and_sampling(model):
    prompt = [5, 17, 42]
    greedy = generate(model, prompt, 6)
    assert greedy[:3] == prompt and len(greedy) == 9
    manual = list(prompt)
    for _ in range(6):
        manual.append(int(next_token_logits(model, torch.tensor([manual[-8:]]))[0].argmax()))
    assert greedy == manual
    assert generate(model, prompt, 6, temperature=1.0, top_k=1, seed=4) == greedy
    a = generate(model, prompt, 6, temperature=1.5, seed=7)
    assert a == generate(model, prompt, 6, temperature=1.5, seed=7) and all(0 <= t < VOCAB for t in a)
    with pytest.raises(ValueError, match="at least one token"):
        generate(model, [], 3)


def test_the_context_cut_is_said_when_prompt_and_new_tokens_exceed_the_sequence_length():
    from ptdp.commands.generate import context_note

    assert context_note(3, 5, 8) is None
    note = context_note(3, 40, 8)
    assert note.startswith(
        "note: the model reads at most its last 8 tokens (the checkpoint's --seq-length); the "
        "prompt (3 tokens) and 40 new tokens make 43"
    )
    assert "sliding window of the 8 tokens" in note and "never seen" not in note
    assert context_note(12, 1, 8).endswith("and the prompt's first 4 tokens are never seen")
