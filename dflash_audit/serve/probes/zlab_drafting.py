"""The z-lab ``dflash`` 0.1.0 drafting step and acceptance against our training forward:
``python zlab_drafting.py SPEC_JSON OUT_JSON`` (z-lab's site and this project on
``PYTHONPATH``; started by :func:`dflash_audit.serve.drafting.compare_drafting`, which
describes the comparison and reads ``OUT_JSON``).

The served side is z-lab's code throughout: its model loaded as z-lab loads a draft
(:func:`zlab_probe.load_served`), the drafting step laid out as ``dflash_generate`` lays out
its first one (``_make_cache``, ``sample``, ``extract_context_feature``,
``_raw_input_embeddings``, the model's forward, ``[:, 1 - B:]``, ``compute_logits`` on
``_output_head(target)``), and the acceptance from ``dflash_generate`` itself (greedy). Its
``return_stats`` calls ``torch.cuda.synchronize`` (``_cuda_time``), so on CPU the acceptance
length of each verify step is read from the target's own calls instead: the target's KV
cache length at each verify call is the loop's ``start``, and step k produced
``start[k+1] - start[k]`` tokens (the ``acceptance_lengths`` z-lab's stats would list).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from zlab_probe import SIDE, ZLabRefused, fill, load_served  # noqa: E402


def prompt_ids(tokenizer: Any, prompt: Any) -> list[int]:
    """Token ids of a prompt: a list of ids as is; a string through the verifier's chat
    template (a user turn and the generation prompt) when it has one, else encoded."""
    if isinstance(prompt, list):
        return [int(i) for i in prompt]
    if getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                            add_generation_prompt=True, tokenize=True)
        ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
        return [int(i) for i in ids]
    return [int(i) for i in tokenizer(prompt)["input_ids"]]


def zlab_step(zm, model, target, ids: list[int]):
    """z-lab's first drafting step after the prefill of ``ids`` (``dflash_generate``,
    ``dflash/model.py:197-268``): ``(draft logits [B-1, V], slot-0 token, prefill hidden
    states)``."""
    n, B = len(ids), int(model.block_size)
    input_ids = torch.tensor([ids])
    position_ids = torch.arange(n + B + 1)[None]
    with torch.inference_mode():
        out = target(input_ids, position_ids=position_ids[:, :n],
                     past_key_values=zm._make_cache(target.config), use_cache=True,
                     logits_to_keep=1, output_hidden_states=True)
        first = int(zm.sample(out.logits, 0.0)[0, -1])
        target_hidden = zm.extract_context_feature(out.hidden_states, model.target_layer_ids)
        block = torch.full((1, B), model.mask_token_id, dtype=torch.long)
        block[0, 0] = first
        noise = zm._raw_input_embeddings(
            target, block, float(zm._draft_value(model.config, "input_embedding_scale", 1.0)))
        hidden = model(target_hidden=target_hidden, noise_embedding=noise,
                       position_ids=position_ids[:, n - target_hidden.shape[1]:n + B],
                       past_key_values=zm._make_cache(model.config), use_cache=True
                       )[:, 1 - B:, :]
        logits = model.compute_logits(hidden, zm._output_head(target))
    return logits[0].float(), first, out.hidden_states


def zlab_generate(zm, model, target, ids: list[int], max_new_tokens: int):
    """z-lab's greedy ``dflash_generate``; ``(output ids, tokens produced per verify step)``."""
    starts: list[int] = []
    forward = target.forward

    def observed(*args, **kwargs):
        cache = kwargs.get("past_key_values")
        starts.append(int(cache.get_seq_length()) if cache is not None else -1)
        return forward(*args, **kwargs)

    target.forward = observed
    try:
        out = zm.dflash_generate(model, target, torch.tensor([ids]), max_new_tokens,
                                 stop_token_ids=None, temperature=0.0)
    finally:
        del target.forward
    end = out.shape[1] - 1  # the loop's final start (output_ids[:, :start + 1])
    verify = starts[1:]  # starts[0] is the prefill
    steps = [b - a for a, b in zip(verify, verify[1:] + [end])]
    return [int(t) for t in out[0]], steps


def run(spec: dict[str, Any]) -> dict[str, Any]:
    import tempfile

    from transformers import AutoModelForCausalLM, AutoTokenizer

    import dflash.model as zm
    from dflash_audit.model.checkpoint import load_pretrained
    from dflash_audit.model.layer_ids import from_zlab_ids
    from dflash_audit.serve.drafting import (
        field_differences,
        teacher_forced_acceptance,
        trained_fields,
        training_logits,
    )
    from dflash_audit.serve.fields import SideRecord, layer_key

    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_pretrained(spec["verifier"], dtype=torch.float32,
                                                  attn_implementation="sdpa").eval()
    tokenizer = AutoTokenizer.from_pretrained(spec["verifier"])
    drafter = load_pretrained(spec["checkpoint"], verifier=target).eval()
    result: dict[str, Any] = {"side": SIDE, "checkpoint": spec["checkpoint"],
                              "verifier": spec["verifier"], "notes": []}
    with tempfile.TemporaryDirectory(prefix="zlab-drafting-") as tmp:
        try:
            model, folder, notes, _ = load_served(Path(spec["served"] or spec["checkpoint"]),
                                               Path(tmp))
        except ZLabRefused as exc:
            return {**result, "refused": str(exc)}
        result["notes"] += notes
        rec = SideRecord(SIDE)
        fill(rec, model, zm, from_zlab_ids, layer_key, torch)
        result["notes"] += rec.notes
        served, trained = rec.fields, trained_fields(drafter)
        result["served_fields"], result["trained_fields"] = served, trained

        # (a) one drafting step on the first prompt
        tol = float(spec["tolerance"])
        ids = prompt_ids(tokenizer, spec["prompts"][0])
        z_logits, first, hs = zlab_step(zm, model, target, ids)
        ours = training_logits(drafter, hs, ids + [first], len(ids))[1:]
        # over the ids both sides compute (a draft vocabulary covers V_d of z-lab's V)
        both = torch.isfinite(ours)
        diff = float((z_logits - ours)[both].abs().max())
        differences = field_differences(served, trained)
        drafts = z_logits.argmax(-1).tolist(), ours.argmax(-1).tolist()
        step = {"context_tokens": len(ids), "block_size": int(model.block_size),
                "slot0_token": first, "served_drafts": drafts[0], "trained_drafts": drafts[1],
                "max_abs_diff": diff, "tolerance": tol,
                "equal": diff <= tol and drafts[0] == drafts[1], "differences": differences,
                "explained": None, "explained_max_abs_diff": None}
        if differences:
            try:
                emulated = training_logits(drafter, hs, ids + [first], len(ids), served)[1:]
                e = float((z_logits - emulated)[torch.isfinite(emulated)].abs().max())
                step["explained"], step["explained_max_abs_diff"] = e <= tol, e
            except Exception as exc:  # noqa: BLE001 - our side cannot run the served values
                result["notes"].append(f"our forward cannot run the served values "
                                       f"({type(exc).__name__}: {exc})")
        result["step"] = step

        # (b) acceptance: z-lab's loop vs the teacher-forced estimate on the same text
        if spec["acceptance"]:
            served_pp, trained_pp, steps_all, eal_sum, blocks = [], [], [], 0.0, 0.0
            for prompt in spec["prompts"]:
                p = prompt_ids(tokenizer, prompt)
                text, steps = zlab_generate(zm, model, target, p, int(spec["max_new_tokens"]))
                steps_all += steps
                served_pp.append(round(sum(steps) / len(steps), 4) if steps else float("nan"))
                with torch.no_grad():
                    out = target(torch.tensor([text]), output_hidden_states=True)
                s, b = teacher_forced_acceptance(drafter, out.hidden_states, out.logits, text,
                                                 len(p))
                eal_sum, blocks = eal_sum + s, blocks + b
                trained_pp.append(round(s / b, 4) if b else float("nan"))
            result["acceptance"] = {
                "prompts": len(spec["prompts"]), "max_new_tokens": int(spec["max_new_tokens"]),
                "served": sum(steps_all) / len(steps_all) if steps_all else float("nan"),
                "trained": eal_sum / blocks if blocks else float("nan"),
                "served_per_prompt": served_pp, "trained_per_prompt": trained_pp,
                "served_verify_steps": len(steps_all), "trained_blocks": int(blocks)}
            result["notes"].append(
                "served: z-lab's greedy dflash_generate (no stop token), tokens per verify "
                "step, the last step cut at the token budget; trained: teacher-forced "
                "leading-run EAL on the same text, an anchor at every generated position with "
                "its whole block inside the text")
    return result


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: zlab_drafting.py SPEC_JSON OUT_JSON", file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[0]).read_text())
    from dflash_audit.serve.fields import jsonable

    Path(argv[1]).write_text(json.dumps(jsonable(run(spec)), indent=1))
    return 0


if __name__ == "__main__":
    from dflash_audit.audit.sides.candidate_runner import die_with_parent

    die_with_parent()  # a kill -9 of serve-check leaves no probe running
    sys.exit(main(sys.argv[1:]))
