"""Speculative decoding evaluation: proposals equal the training forward, decoding is
lossless (equals the verifier's greedy output), acceptance is counted per verify step."""

from __future__ import annotations

import pytest
import torch
import train_tiny as tt

from dflash_audit.data.capture import capture_row
from dflash_audit.data.conversations import Conversation
from dflash_audit.model.config import DFlashConfig
from dflash_audit.model.drafter import DFlashDrafter
from dflash_audit.model.verifier_weights import load_verifier_weights
from dflash_audit.train import decode as dec
from dflash_audit.train import evaluate as ev

PROMPTS = [[1, 20, 21, 22, 23, 24, 25, 26], [1, 30, 31, 40, 41, 5, 6, 7, 8, 9, 10, 11, 12],
           [1, 60, 61]]


@pytest.fixture(scope="module")
def verifier(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    folder = tt.make_verifier(tmp_path_factory.mktemp("verifier"))
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def drafter_for(verifier, seed=0, **changes) -> DFlashDrafter:
    config = DFlashConfig.from_verifier_config(
        verifier.config, target_layer_ids=tt.TARGET_LAYERS,
        mask_token_id=verifier.config.vocab_size - 1, block_size=4).replace(**changes)
    torch.manual_seed(seed)
    model = DFlashDrafter(config)
    if config.uses_draft_vocab:
        keep = torch.arange(0, config.vocab_size, 2)[: config.effective_draft_vocab_size]
        model.t2d.zero_()
        model.t2d[keep] = True
        model.d2t.copy_(keep - torch.arange(keep.numel()))
    load_verifier_weights(model, verifier)
    return model.eval()


LAYOUTS = {
    "full": {},
    "sliding-causal": dict(layer_types=("sliding_attention",), sliding_window=5),
    "two-layers-mixed": dict(num_hidden_layers=2,
                             layer_types=("full_attention", "sliding_attention"),
                             sliding_window=7, sliding_window_non_causal=True),
    "sample-from-anchor": dict(sample_from_anchor=True),
    "draft-vocab": dict(draft_vocab_size=40),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_propose_equals_training_forward_at_that_anchor(verifier, layout):
    drafter = drafter_for(verifier, **LAYOUTS[layout])
    T, B = 30, drafter.config.block_size
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(4, 90, (1, T), generator=gen)
    docs = torch.zeros(1, T, dtype=torch.long)
    hidden, last = capture_row(verifier, ids, docs, tt.TARGET_LAYERS)
    for p in (1, 9, 17, T - B - 1):
        with torch.no_grad():
            out = drafter(hidden_states=hidden, input_ids=ids, loss_mask=torch.ones(1, T),
                          verifier_last_hidden_states=last, document_ids=docs,
                          position_ids=torch.arange(T)[None],
                          anchor_positions=torch.tensor([p]), anchor_valid=torch.tensor([True]))
            context = drafter.context(hidden[:, :p])
        logits = dec.propose_logits(drafter, context, int(ids[0, p]))
        torch.testing.assert_close(logits, out.logits[0], atol=1e-5, rtol=1e-5)
        drafts = dec.propose(drafter, context, int(ids[0, p]))
        start = 0 if drafter.config.sample_from_anchor else 1
        expect = out.logits[0, start:].argmax(-1)
        if drafter.config.uses_draft_vocab:
            expect = expect + drafter.d2t[expect]  # verifier id = i + d2t[i]
            assert all(drafter.t2d[d] for d in drafts)
        assert drafts == expect.tolist()
        assert len(drafts) == dec.num_drafts(drafter)


def _oracle(greedy_by_prompt, correct: int):
    """A proposer that knows the verifier's greedy continuation; the first ``correct``
    drafts are right, the rest wrong."""
    def propose(drafter, context, last_token):
        p = context.shape[1]
        prompt_len, greedy = greedy_by_prompt[0]
        i = p - prompt_len  # index of last_token in the generated tokens
        k = dec.num_drafts(drafter)
        truth = greedy[i + 1:i + 1 + k] + [0] * k
        return [t if j < correct else (t + 1) % 90 + 4 for j, t in enumerate(truth[:k])]
    return propose


@pytest.mark.parametrize("correct", [0, 2, 3])
def test_decoding_is_lossless_and_counts_acceptance(verifier, monkeypatch, correct):
    drafter = drafter_for(verifier)
    K = dec.num_drafts(drafter)
    for prompt in PROMPTS:
        greedy = dec.greedy_generate(verifier, prompt, 20)
        monkeypatch.setattr(dec, "propose", _oracle([(len(prompt), greedy)], correct))
        gen = dec.speculative_generate(drafter, verifier, prompt, 20)
        assert gen.tokens == greedy
        # every step but the last (cut by the budget) emits min(correct, K) + 1 tokens
        assert gen.acceptance[:-1] == [min(correct, K) + 1] * (len(gen.acceptance) - 1)
        assert 1 + sum(gen.acceptance) == len(gen.tokens)  # + the prefill's token


@pytest.mark.parametrize("correct", [0, 2])
def test_batched_decoding_equals_one_by_one(verifier, monkeypatch, correct):
    drafter = drafter_for(verifier)
    K = dec.num_drafts(drafter)
    truth = {}  # (position of the last token, last token) -> next K greedy tokens
    for prompt in PROMPTS:
        greedy = dec.greedy_generate(verifier, prompt, 18)
        full = list(prompt) + greedy
        for i in range(len(prompt), len(full)):
            truth[(i, full[i])] = (full[i + 1:i + 1 + K] + [0] * K)[:K]

    def oracle(drafter, context, last_token):
        right = truth.get((context.shape[1], last_token), [0] * K)
        return [t if j < correct else (t + 1) % 90 + 4 for j, t in enumerate(right)]

    monkeypatch.setattr(dec, "propose", oracle)
    batched = dec.speculative_generate_batch(drafter, verifier, PROMPTS, 18)
    for prompt, gen in zip(PROMPTS, batched):
        single = dec.speculative_generate(drafter, verifier, prompt, 18)
        assert gen.tokens == single.tokens == dec.greedy_generate(verifier, prompt, 18)
        assert gen.acceptance == single.acceptance
        assert gen.acceptance[0] == correct + 1


def test_real_drafter_is_lossless_and_result_is_pooled(verifier):
    drafter = drafter_for(verifier, seed=3)
    batched = dec.speculative_generate_batch(drafter, verifier, PROMPTS, 16)
    for prompt, gen in zip(PROMPTS, batched):
        single = dec.speculative_generate(drafter, verifier, prompt, 16)
        assert gen.tokens == single.tokens == dec.greedy_generate(verifier, prompt, 16)
        assert gen.acceptance == single.acceptance
    result = ev.evaluate_acceptance(drafter, verifier, PROMPTS, max_new_tokens=16,
                                    batch_size=2)
    assert result.prompts == 3 and result.generated_tokens == 48
    assert result.verify_steps == sum(result.histogram)
    assert result.acceptance_length == pytest.approx(
        sum((k + 1) * n for k, n in enumerate(result.histogram)) / result.verify_steps)
    assert 1.0 <= result.acceptance_length <= 4.0
    assert drafter.training is False


def test_progress_is_reported_after_every_verify_step(verifier):
    """The progress callback sees every verify step: its last report equals the result (tokens,
    verify steps, acceptance length) and the prompt count only grows."""
    drafter = drafter_for(verifier)
    seen: list[ev.EvalProgress] = []
    result = ev.evaluate_acceptance(drafter, verifier, PROMPTS, max_new_tokens=16,
                                    batch_size=2, progress=seen.append)
    # one report after each batch's prefill, one per verify step of that batch (its rows
    # verify together: as many steps as its longest-running row)
    order = sorted(range(len(PROMPTS)), key=lambda i: len(PROMPTS[i]))
    batches = [[PROMPTS[i] for i in order[b:b + 2]] for b in range(0, len(order), 2)]
    steps = [max(len(g.acceptance) for g in dec.speculative_generate_batch(
        drafter, verifier, chunk, 16)) for chunk in batches]
    assert len(seen) == len(batches) + sum(steps)
    last = seen[-1]
    assert (last.prompts_done, last.prompts) == (3, 3)
    assert last.tokens == result.generated_tokens == 48 and last.max_tokens == 48
    assert last.verify_steps == result.verify_steps
    assert last.acceptance_length == pytest.approx(result.acceptance_length)
    done = [p.prompts_done for p in seen]
    assert done == sorted(done) and done[0] == 0
    assert [p.tokens for p in seen] == sorted(p.tokens for p in seen)
    assert "3/3 prompts, acceptance" in last.describe()


def test_eos_stops_generation(verifier):
    drafter = drafter_for(verifier)
    prompt = PROMPTS[0]
    greedy = dec.greedy_generate(verifier, prompt, 12)
    eos = greedy[4]
    gen = dec.speculative_generate(drafter, verifier, prompt, 12, eos_ids=[eos])
    assert gen.tokens == greedy[: greedy.index(eos) + 1]
    batched = dec.speculative_generate_batch(drafter, verifier, [prompt, PROMPTS[1]], 12,
                                            eos_ids=[eos])
    assert batched[0].tokens == gen.tokens and batched[0].acceptance == gen.acceptance


def test_held_out_prompts_skip_training_sources():
    tokenizer = tt.make_tokenizer()
    convs = [Conversation(messages=tuple(c["messages"]), source=f"f.jsonl:{i}")
             for i, c in enumerate(tt.conversations(6))]
    prompts, used = ev.held_out_prompts(tokenizer, convs, max_prompts=3,
                                        exclude_sources=["f.jsonl:5+regen", "f.jsonl:3"],
                                        turns_per_conversation=2)
    assert used == ["f.jsonl:4", "f.jsonl:2"]
    assert len(prompts) == 3
    first = tokenizer.apply_chat_template(list(convs[4].messages[:1]), tokenize=False,
                                          add_generation_prompt=True)
    assert tokenizer.decode(prompts[0]) == first
