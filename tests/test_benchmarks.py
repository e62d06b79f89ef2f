"""The claim benchmarks' bookkeeping, without a model (benchmarks/claims/claim_runs.py): a run kept as a record is read
back, a finished run folder is recorded, an interrupted one resumes from its checkpoint, anything else starts afresh;
and the OC-GRPO benchmark's sample-matched group size and verdict rule."""

import dataclasses
import json
import os
import re
import types

import pytest

import oc_grpo
from benchmarks.claims import claim_runs
from benchmarks.claims import oc_grpo_smollm2 as bench


def make_run(args, steps_logged: int, final_eval: bool, checkpoint: bool, **changed) -> str:
    """A run folder as the trainer leaves it: args.json (derived sizes filled in), metric rows, a checkpoint."""
    run_dir = os.path.join(args.output_dir, args.run_name)
    os.makedirs(run_dir, exist_ok=True)
    saved = {**json.loads(json.dumps(dataclasses.asdict(args))), "batch_size": 32, "minibatch_size": 32, **changed}
    with open(os.path.join(run_dir, "args.json"), "w") as f:
        json.dump(saved, f)
    rows = [{"step": 0, "time": 1.0, "eval/greedy_accuracy": 0.1}]
    rows += [{"step": s, "time": 1.0 + s, "reward/mean": 0.0, "perf/step_time": 2.0}
             for s in range(1, steps_logged + 1)]
    if final_eval:
        rows.append({"step": args.total_steps, "time": 20.0, "eval/greedy_accuracy": 0.2})
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    if checkpoint:
        os.makedirs(os.path.join(run_dir, "checkpoint"), exist_ok=True)
        open(os.path.join(run_dir, "checkpoint", "trainer_state.pt"), "w").close()
    return run_dir


def fake_trainer(calls: list):
    """oc_grpo's Args with a main that records its --resume and leaves a finished run folder, as the real one does."""
    def main(a):
        calls.append(a.resume)
        make_run(a, a.total_steps, final_eval=True, checkpoint=True)
    return types.SimpleNamespace(Args=oc_grpo.Args, main=main)


def args_in(tmp_path, **kw):
    return oc_grpo.Args(output_dir=str(tmp_path / "runs"), run_name="r", **{"total_steps": 3, **kw})


def test_a_finished_folder_is_recorded_once_and_read_back_from_the_record(tmp_path):
    args, calls, measured = args_in(tmp_path), [], []
    make_run(args, 3, final_eval=True, checkpoint=True)
    assert claim_runs.folder_state(oc_grpo, args) == "finished"
    record = claim_runs.finished_run(fake_trainer(calls), args, str(tmp_path / "rec"),
                                     lambda d: measured.append(d) or {"x": 1})
    assert calls == [] and measured == [str(tmp_path / "runs" / "r")]  # not rerun; measured on the final weights
    assert record["measured"] == {"x": 1} and [r["step"] for r in record["rows"]] == [0, 1, 2, 3, 3]
    os.rename(tmp_path / "runs", tmp_path / "gone")  # a new session's checkout: no run folders
    again = claim_runs.finished_run(fake_trainer(calls), args, str(tmp_path / "rec"), lambda d: measured.append(d))
    assert again == json.loads(json.dumps(record)) and calls == [] and len(measured) == 1


def test_a_record_is_read_back_for_a_folder_elsewhere_but_not_when_its_weights_are_needed(tmp_path):
    args, calls = args_in(tmp_path), []
    claim_runs.finished_run(fake_trainer(calls), args, str(tmp_path / "rec"))
    moved = dataclasses.replace(args, output_dir=str(tmp_path / "clone" / "runs"))  # a clone at another path
    claim_runs.finished_run(fake_trainer(calls), moved, str(tmp_path / "rec"))
    assert calls == [""]  # read back: where the run folder lives does not make it another run
    record = claim_runs.finished_run(fake_trainer(calls), moved, str(tmp_path / "rec"), weights=True)
    assert calls == ["", ""] and os.path.exists(tmp_path / "clone" / "runs" / "r" / "checkpoint")  # made again
    claim_runs.finished_run(fake_trainer(calls), moved, str(tmp_path / "rec"), weights=True)
    assert calls == ["", ""] and record["args"]["output_dir"] == moved.output_dir  # the folder is there now


def test_a_record_of_other_arguments_is_not_read_back(tmp_path):
    args, calls = args_in(tmp_path), []
    claim_runs.finished_run(fake_trainer(calls), args, str(tmp_path / "rec"))
    assert calls == [""]  # nothing there: a fresh run
    other = dataclasses.replace(args, learning_rate=1e-3, output_dir=str(tmp_path / "elsewhere"))
    record = claim_runs.finished_run(fake_trainer(calls), other, str(tmp_path / "rec"))
    assert calls == ["", ""] and record["args"]["learning_rate"] == 1e-3


def test_a_flag_added_later_at_its_default_is_the_same_run(tmp_path):
    args = args_in(tmp_path)
    run_dir = make_run(args, 3, final_eval=True, checkpoint=True)
    with open(os.path.join(run_dir, "args.json")) as f:
        saved = json.load(f)
    del saved["is_clip_min"]  # as if the flag did not exist when the run was made
    with open(os.path.join(run_dir, "args.json"), "w") as f:
        json.dump(saved, f)
    assert claim_runs.folder_state(oc_grpo, args) == "finished"
    assert claim_runs.folder_state(oc_grpo, dataclasses.replace(args, is_clip_min=0.3)) == "stale"
    assert claim_runs.folder_state(oc_grpo, dataclasses.replace(args, save_every=7)) == "finished"  # no effect


def test_a_run_of_no_steps_is_finished_by_its_one_evaluation(tmp_path):
    # ppo_slm's stages alone (--total-steps 0) log one evaluation, at step 0: a benchmark that needs their weights
    # must find the folder finished, not move it aside and train the stages again
    args = args_in(tmp_path, total_steps=0)
    make_run(args, 0, final_eval=False, checkpoint=False)
    assert claim_runs.folder_state(oc_grpo, args) == "finished"
    longer = args_in(tmp_path, total_steps=3)
    make_run(longer, 0, final_eval=False, checkpoint=False)  # the same row in a run of 3 steps: its start only
    assert claim_runs.folder_state(oc_grpo, longer) == "stale"


def test_an_interrupted_run_resumes_from_its_checkpoint(tmp_path):
    args, calls = args_in(tmp_path, total_steps=6), []
    make_run(args, 4, final_eval=False, checkpoint=True)
    claim_runs.finished_run(fake_trainer(calls), args, str(tmp_path / "rec"))
    assert calls == [str(tmp_path / "runs" / "r")]  # --resume the run folder


def test_another_or_unsaved_run_is_moved_aside_and_started_afresh(tmp_path):
    args, calls = args_in(tmp_path, total_steps=6), []
    make_run(args, 2, final_eval=False, checkpoint=False)  # killed before its first checkpoint
    claim_runs.finished_run(fake_trainer(calls), args, str(tmp_path / "rec"))
    assert calls == [""] and [p for p in os.listdir(tmp_path / "runs") if p.startswith("r.stale-")]
    make_run(args, 6, final_eval=True, checkpoint=True, learning_rate=1e-3)  # other arguments
    assert claim_runs.folder_state(oc_grpo, args) == "stale"
    assert claim_runs.folder_state(oc_grpo, dataclasses.replace(args, run_name="absent")) == "fresh"


def test_seconds_are_the_runs_own(tmp_path):
    args = args_in(tmp_path)
    run_dir = make_run(args, 3, final_eval=True, checkpoint=True)
    os.utime(os.path.join(run_dir, "args.json"), (0.0, 0.0))
    rows = claim_runs.read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    assert claim_runs.run_seconds(run_dir, rows) == 1.0 + 3 * 2.0 + (20.0 - 4.0)  # first eval, steps, final eval


def test_sample_matched_group_size_counts_the_cascades_draws():
    rows = [{"guide/zero_reward_groups": 2.0, "guide/rescued_groups": 1.0, "guide/groups_at_f1": 1.0},
            {"guide/zero_reward_groups": 0.0, "guide/rescued_groups": 0.0, "guide/groups_at_f1": 0.0}]
    assert bench.matched_group_size(rows, 8, 4) == 10  # (48 + 32) / 2 completions a step over 4 prompts
    two = [{"guide/zero_reward_groups": 1.0, "guide/rescued_groups": 1.0, "guide/groups_at_f0.5": 0.0,
            "guide/groups_at_f1": 1.0}]
    assert bench.matched_group_size(two, 8, 4) == 12  # rescued at the second fraction: two tries


def test_verdict_needs_both_controls_beaten_beyond_the_noise_on_every_seed():
    def res(oc, grpo, matched):
        return {(arm, 1): {"after": {3: a, 4: 0.0}} for arm, a in zip(bench.VERDICT_ARMS, (oc, grpo, matched))}

    assert bench.verdict(res(0.5, 0.0, 0.0), [1], 40, 3)[0] == "shown"
    assert bench.verdict(res(0.5, 0.0, 0.45), [1], 40, 3)[0] == "partly"
    assert bench.verdict(res(0.025, 0.0, 0.0), [1], 40, 3)[0] == "not shown"  # one problem: within the noise
    assert bench.verdict(res(0.5, 0.0, 0.0), [1], 40, 4)[0] == "not shown"  # judged at the cliff the premise picked
    assert bench.verdict({}, [], 40, 3)[0] is None


def premise_cell(p: float, leaks: int = 0) -> dict:
    return {"pass_at_k": p, "leaks": leaks, "n": 40, "k": 8}


def test_oc_grpo_premise_rule():
    """A level passes with an unguided pass@8 in [0.05, 0.30] and a guided fraction above it beyond the noise whose
    guidance states no answer; the passing fractions are those."""
    from benchmarks.premises.oc_grpo_premise_smollm2 import passing

    assert passing({(3, 0.0): premise_cell(0.1), (3, 0.25): premise_cell(0.15), (3, 0.5): premise_cell(0.45),
                    (3, 0.75): premise_cell(0.5)}) == {3: [0.5, 0.75]}  # 0.25: +0.05, inside +-0.14
    assert passing({(3, 0.0): premise_cell(0.05), (3, 0.5): premise_cell(0.4)}) == {3: [0.5]}  # the band's edges
    assert passing({(3, 0.0): premise_cell(0.3), (3, 0.5): premise_cell(0.7)}) == {3: [0.5]}
    assert passing({(3, 0.0): premise_cell(0.1), (3, 0.5): premise_cell(0.45, leaks=1)}) == {}  # a copied answer
    assert passing({(3, 0.0): premise_cell(0.0), (3, 0.5): premise_cell(0.45)}) == {}  # all-fail: nothing to learn
    assert passing({(3, 0.0): premise_cell(0.35), (3, 0.5): premise_cell(0.9)}) == {}  # not a cliff
    assert passing({(3, 0.0): premise_cell(0.1), (3, 0.5): premise_cell(0.225)}) == {}  # +0.125 inside +-0.16
    assert passing({(3, 0.0): premise_cell(0.1)}) == {}  # no guided cell


def test_oc_grpo_premise_picks_the_claims_cliff_and_fractions():
    from benchmarks.premises.oc_grpo_premise_smollm2 import cliff_design, untestable_figures

    cells = {(2, 0.0): premise_cell(0.2), (2, 0.5): premise_cell(0.5), (3, 0.0): premise_cell(0.05),
             (3, 0.25): premise_cell(0.3), (3, 0.5): premise_cell(0.6), (5, 0.0): premise_cell(0.0),
             (5, 0.5): premise_cell(0.9)}
    assert cliff_design(cells) == (3, [0.25, 0.5])  # the largest lift of the passing levels (2 and 3)
    del cells[(3, 0.5)], cells[(3, 0.25)], cells[(2, 0.5)]
    assert cliff_design(cells) is None
    assert "L3 0.050; L5 0.000 -> 0.900 at f 0.5, noise +-0.218; guidance states the answer in 0 of 40" in \
        untestable_figures(cells)  # the verdict's figures: level 5 lifted, but from an all-fail start


def test_the_claim_reads_the_premise_records_and_never_measures_them(tmp_path):
    from benchmarks.premises import oc_grpo_premise_smollm2 as premise

    records = str(tmp_path)
    with pytest.raises(SystemExit, match=re.escape(premise.COMMAND)):  # nothing recorded: a one-line error
        premise.recorded_cells(records)
    for lv in premise.LEVELS:
        for f in premise.FRACTIONS:
            claim_runs.cached(premise.cell_path(records, "base", lv, f), premise.settings("base", lv, f),
                              lambda: premise_cell(0.1))
    with pytest.raises(SystemExit, match=re.escape(premise.COMMAND)):  # made with other settings: not this premise
        premise.recorded_cells(records, fractions=(0.0, 0.9))
    got = premise.recorded_cells(records)
    assert set(got) == {"base"}  # the post-GRPO start is not recorded: left out, not an error
    assert got["base"][(3, 0.5)]["pass_at_k"] == 0.1
    path = premise.cell_path(records, "base", 3, 0.5)
    with open(path) as f:
        old = {**json.load(f), "ground": claim_runs.GROUND - 1}
    with open(path, "w") as f:
        json.dump(old, f)
    with pytest.raises(SystemExit, match="made on testbed-nl version"):  # other problems or guidance: not read
        premise.recorded_cells(records)


def test_oc_grpo_premise_copies_a_cell_only_where_every_guided_prompt_is_the_same():
    """testbed-nl's guidance stops before the result step, so on level 3's two-step solutions 0.75 gives 0.5's text:
    that cell is the same measurement; level 2's three-step solutions differ."""
    from benchmarks.premises.oc_grpo_premise_smollm2 import same_prompts
    from common.data import load_problems
    from common.models import load_tokenizer
    from grounds import path_of

    tokenizer = load_tokenizer(path_of("smollm2-135m-instruct"))
    for lv, twin in ((3, 0.5), (2, None)):
        problems = load_problems("testbed-nl", "test", (lv,), 40, 1)
        cells = {(lv, 0.0): premise_cell(0.1), (lv, 0.25): premise_cell(0.1), (lv, 0.5): premise_cell(0.1)}
        assert same_prompts(cells, problems, tokenizer, lv, 0.75) == twin


def test_adakp_verdict_needs_both_baselines_beaten_beyond_the_noise_on_both_seeds():
    from benchmarks.claims.adakp_smollm2 import verdict

    def after(a1, a2, s=(0.2, 0.2), z=(0.2, 0.2)):
        return {("adakp", 1): a1, ("adakp", 2): a2, ("static", 1): s[0], ("static", 2): s[1],
                ("none", 1): z[0], ("none", 2): z[1]}

    assert verdict(after(0.6, 0.6), [1, 2], 40)[0] == "shown"  # +0.40 against a +-0.19 noise, both seeds
    assert verdict(after(0.3, 0.3), [1, 2], 40)[0] == "partly shown"  # ahead on both, inside the noise
    assert verdict(after(0.6, 0.1), [1, 2], 40)[0] == "partly shown"  # beyond on seed 1 only
    assert verdict(after(0.6, 0.6, s=(0.6, 0.2)), [1, 2], 40)[0] == "partly shown"  # static caught up on seed 1
    assert verdict(after(0.2, 0.1), [1, 2], 40)[0] == "not shown"
    assert len(verdict(after(0.2, 0.1), [1, 2], 40)[1]) == 4  # a line per seed and baseline


def test_adakp_gate_needs_the_helpful_kps_to_lift_no_hint_accuracy_beyond_the_noise():
    from benchmarks.claims.adakp_smollm2 import premise

    line, failed = premise({"none": 0.150, "helpful": 0.450}, 40)  # +0.300 against a +-0.17 noise
    assert failed == [] and line.endswith(": pass")
    line, failed = premise({"none": 0.150, "helpful": 0.250}, 40)  # +0.100: inside the noise
    assert line.endswith("**fail**") and failed[0].startswith("premise, helpful KPs 0.250 - no hint 0.150 = +0.100")
    assert premise({"none": 0.150, "helpful": 0.100}, 40)[1]  # a fall (issue 60's start on testbed-nl version 2)
    assert premise({"none": 0.0, "helpful": 0.0}, 40)[1]  # no lift at all, where the noise is 0
    assert not premise({"none": 0.150, "helpful": 0.250}, 10_000)[1]  # the same lift on many problems: beyond it


def direct_opd_acc(lift=(0.6, 0.8), hold=(0.4, 0.4), grpo=((0.6, 0.65), (0.4, 0.4)), control=((0.6, 0.6), (0.4, 0.4)),
                   control_seeds=(1, 2)):
    """{(arm, seed): {group: (before, after)}} of direct_opd_smollm2's arms, the same on seeds 1 and 2."""
    acc = {}
    for s in (1, 2):
        acc[("direct", s)] = {"lift": lift, "hold": hold}
        acc[("vanilla_opd", s)] = {"lift": (lift[0], 0.7), "hold": (hold[0], 0.1)}
        acc[("grpo_student", s)] = dict(zip(("lift", "hold"), grpo))
        if s in control_seeds:
            acc[("control", s)] = dict(zip(("lift", "hold"), control))
    return acc


def test_direct_opd_verdict_judges_the_lift_and_the_hold_group_apart():
    from benchmarks.claims.direct_opd_smollm2 import verdict

    sizes = {(g, s): 170 if g == "lift" else 150 for g in ("lift", "hold") for s in (1, 2)}  # noise about +-0.10
    assert verdict(direct_opd_acc(), [1, 2], sizes)[0] == "shown"  # +0.20 on the lift group, the hold group kept
    # lifted, but pulled down where the pair is weak: half the claim
    assert verdict(direct_opd_acc(hold=(0.4, 0.15)), [1, 2], sizes)[0] == "partly shown"
    assert verdict(direct_opd_acc(lift=(0.6, 0.65)), [1, 2], sizes)[0] == "partly shown"  # up on both, inside the noise
    assert verdict(direct_opd_acc(lift=(0.6, 0.65), hold=(0.4, 0.15)), [1, 2], sizes)[0] == "not shown"
    assert verdict(direct_opd_acc(lift=(0.6, 0.55)), [1, 2], sizes)[0] == "not shown"  # no lift
    # the hold gate failed (no room to fall): that half is untestable, the lift alone is partly the claim
    status, notes = verdict(direct_opd_acc(), [1, 2], sizes, ["headroom, the control starts at 0.050 / 0.050"])
    assert status == "partly shown" and "hold (no pull-down): untestable here: headroom" in notes[0]
    # the control must be run and stay still for the whole claim
    assert verdict(direct_opd_acc(control=((0.6, 0.9), (0.4, 0.4))), [1, 2], sizes)[0] == "partly shown"
    assert verdict(direct_opd_acc(control_seeds=(1,)), [1, 2], sizes)[0] == "shown"  # run on seed 1 only: enough
    assert verdict(direct_opd_acc(control_seeds=()), [1, 2], sizes)[0] == "partly shown"


def test_direct_opd_verdict_is_void_where_grpo_with_the_verifier_falls():
    from benchmarks.claims.direct_opd_smollm2 import verdict

    sizes = {(g, s): 170 if g == "lift" else 150 for g in ("lift", "hold") for s in (1, 2)}
    # the last design: GRPO on the student fell 0.883 -> 0.717; here on the hold group (level 3) alone
    status, _ = verdict(direct_opd_acc(grpo=((0.6, 0.65), (0.4, 0.2))), [1, 2], sizes)
    assert status.startswith("untestable here: the learning rate breaks the control") and "seed 1 hold 0.400 -> 0.200" \
        in status and status.endswith("(the rule alone: shown)")


def direct_opd_record(l1, l2, l3):
    """A trainer's record with its first and last evaluation per level ((before, after) each)."""
    row = lambda i: {f"eval/greedy_accuracy/level_{lv}": x[i] for lv, x in ((1, l1), (2, l2), (3, l3))}  # noqa: E731
    return {"rows": [{"step": 0, "eval/greedy_accuracy": 0.0, **row(0)}, {"step": 5, "reward/mean": 0.0},
                     {"step": 30, "eval/greedy_accuracy": 0.0, **row(1)}]}


def test_direct_opd_learning_rate_is_the_largest_at_which_grpo_keeps_both_groups():
    from benchmarks.claims.direct_opd_smollm2 import choose_lr, distinct, run_groups

    groups, n = {"lift": (1, 2), "hold": (3,)}, 150
    sizes = {"lift": distinct(1, n, 1) + distinct(2, n, 1), "hold": distinct(3, n, 1)}
    assert sizes == {"lift": 170, "hold": 150}  # level 1 has 20 sums, repeated
    # level 1 counts by its 20 distinct sums, not its 150 rows: 1.0 -> 0.0 there moves the lift group by 20/170
    assert run_groups(direct_opd_record((1.0, 0.0), (0.5, 0.5), (0.3, 0.3)), groups, n, 1)["lift"] == \
        pytest.approx((95 / 170, 75 / 170))
    probes = {5e-6: run_groups(direct_opd_record((1.0, 1.0), (0.6, 0.6), (0.4, 0.2)), groups, n, 1),  # level 3 fell
              2e-6: run_groups(direct_opd_record((1.0, 1.0), (0.6, 0.62), (0.4, 0.38)), groups, n, 1)}
    assert choose_lr(probes, sizes) == 2e-6
    probes[1e-6] = run_groups(direct_opd_record((1.0, 1.0), (0.6, 0.6), (0.4, 0.4)), groups, n, 1)
    assert choose_lr(probes, sizes) == 2e-6  # the largest that holds, not the stillest
    assert choose_lr({5e-6: probes[5e-6]}, sizes) is None  # none holds: no arm runs


def test_direct_opd_cap_is_the_smallest_that_cuts_under_a_tenth_of_the_base_replies_or_where_the_cuts_flatten():
    from benchmarks.claims.direct_opd_smollm2 import choose_cap, cut_shares

    # one draw at the largest cap: 100 replies, 60 longer than 48 tokens, 12 longer than 96, 5 cut at 128
    lengths = [30] * 40 + [60] * 48 + [110] * 7 + [128] * 5
    shares = cut_shares(lengths, [False] * 95 + [True] * 5, (48, 96, 128))
    assert shares == {48: 0.6, 96: 0.12, 128: 0.05}
    assert choose_cap(shares) == 128
    assert choose_cap({48: 0.6, 96: 0.12}) is None  # 96 is the largest: nothing to compare it with
    # none under a tenth: the smallest within 0.05 of the largest (issue 63's draw), not the largest
    assert choose_cap({48: 0.344, 96: 0.164, 128: 0.141, 192: 0.102}) == 128
    assert choose_cap({48: 0.6, 96: 0.3, 128: 0.2}) is None  # still falling by 0.10 at the largest


def test_direct_opd_student_is_the_most_trained_with_headroom_on_the_lift_group():
    from benchmarks.claims.direct_opd_smollm2 import choose_student, split_levels

    pre, post = {"L1": 0.55, "L2": 0.225, "L3": 0.0}, {"L1": 1.0, "L2": 0.6, "L3": 0.025}
    assert split_levels(pre, post, 40) == ((1, 2), (3,))  # level 3's +0.025 is noise: the pair is weak there
    assert choose_student({10: 0.42, 20: 0.64, 30: 0.79, 60: 0.96}) == 30  # 60 steps: no headroom (the last design)
    assert choose_student({10: 0.42, 20: 0.85}) is None


def test_mada_stage_1_setting_is_the_band_then_the_judged_split_then_mixed_groups():
    from benchmarks.claims.mada_rl_smollm2 import choose_setting

    def cell(acc, level, temp, mixed):
        return {"accuracy": acc, "level": level, "temperature": temp, "mixed": mixed, "held_out": 20 * level}

    cells = {"L1 T1": cell(0.45, 1, 1.0, 0.8), "L1 T0.7": cell(0.55, 1, 0.7, 0.6),
             "L2 T1": cell(0.06, 2, 1.0, 0.3), "L2 T0.7": cell(0.19, 2, 0.7, 0.5)}
    assert choose_setting(cells) == "L1 T1"  # level 2 below the band at both temperatures; then the most mixed groups
    cells["L2 T0.7"]["accuracy"] = 0.21
    assert choose_setting(cells) == "L2 T0.7"  # in the band now: its 40 held-out problems beat level 1's 20
    cells["L2 T1"].update(accuracy=0.3, mixed=0.5)
    assert choose_setting(cells) == "L2 T1"  # as mixed: the higher temperature
    assert choose_setting({k: {**c, "accuracy": 0.05} for k, c in cells.items()}) is None  # none in the band
    assert choose_setting({"L1 T1": cell(0.85, 1, 1.0, 0.3)}) is None  # above it: groups mostly all right
    assert choose_setting(cells, levels=[1]) == "L1 T1"  # level 2's critic premise fails: only level 1 counts
    assert choose_setting(cells, levels=[]) is None


def test_mada_learning_rate_is_one_that_keeps_every_generator():
    from benchmarks.claims.mada_rl_smollm2 import choose_lr

    def probe(*gens, base=0.225):
        return {"base": base, "gens": list(gens), "n": 40}

    # the demo's failure: two generators collapse to 0.000 while one learns; the mean is up, the rate is refused
    assert choose_lr({1e-4: probe(0.225, 0.25, 0.2), 1e-3: probe(0.7, 0.0, 0.0)}) == 1e-4
    assert choose_lr({1e-4: probe(0.25, 0.25, 0.225), 3e-4: probe(0.4, 0.3, 0.35)}) == 3e-4  # the larger gain
    assert choose_lr({1e-4: probe(0.3, 0.3, 0.3), 3e-4: probe(0.3, 0.3, 0.3)}) == 1e-4  # a tie: the smaller rate
    assert choose_lr({1e-4: probe(0.2, 0.2, 0.2), 3e-4: probe(0.0, 0.0, 0.05)}) is None  # below the base: none keeps


def test_mada_gate_fails_on_an_identically_zero_counterfactual_baseline():
    from benchmarks.claims.mada_rl_smollm2 import baseline_headroom, gates_of

    varied = [0.0, 1 / 3, 2 / 3, 1.0, 1 / 3, 0.0]
    line, failed = baseline_headroom({1: varied, 2: [0.0] * 6})  # the last run's seed 2: every generator wrong
    assert line.endswith(": **fail**") and failed == ["headroom, acc_G identically 0.000 on seed 2"]
    assert "seed 2: mean 0.000 over 6 problems, 0/3 right 1.00, 1/3 right 0.00" in line
    assert baseline_headroom({1: varied, 2: varied}) == (baseline_headroom({1: varied, 2: varied})[0], [])
    assert baseline_headroom({1: [1 / 3] * 6})[1] == ["headroom, acc_G identically 0.333 on seed 1"]  # no variation
    assert baseline_headroom({1: [0.0] * 5 + [1 / 3] * 1})[1] == ["headroom, acc_G mean 0.056 on seed 1"]
    cli = types.SimpleNamespace(num_eval_problems=40, seeds=[1, 2])
    stage1 = {1: {"base": 0.225, "acc_g": varied}, 2: {"base": 0.275, "acc_g": [0.0] * 6}}
    gates = gates_of(cli, 2, stage1)
    for name in ("debate", "critic"):  # the line stands in each claim's gate and fails both
        assert f"- headroom ({name}, counterfactual baseline): acc_G" in "\n".join(gates[name][0])
        assert "headroom, acc_G identically 0.000 on seed 2" in gates[name][1]
    assert "untestable here: " in "\n".join(claim_runs.gate_section(list(gates.values()), list(gates)))


def test_mada_verdicts_compare_debate_with_the_vote_the_best_generator_and_the_plain_critics():
    from benchmarks.claims.mada_rl_smollm2 import arm_lines

    def rec(debate, vote=0.3, gens=(0.3, 0.3, 0.3), improvement=0.1):
        ev = lambda d: {"mada/eval/debate_accuracy": d, "mada/eval/majority_accuracy": vote,  # noqa: E731
                        "mada/eval/single_accuracy": sum(gens) / 3, "mada/eval/improvement_rate": improvement,
                        "mada/eval/break_rate": 0.2, "mada/eval/problems": 40,
                        **{f"mada/eval/single_accuracy/gen{g}": a for g, a in enumerate(gens)}}
        return {"rows": [ev(0.3), {"mada/stage": 3, "mada/beats_generators": 0.05}, ev(debate)], "seconds": 60.0}

    cli = types.SimpleNamespace(seeds=[1, 2])
    kept = {s: {"base": 0.225, "gens": [0.3, 0.3, 0.3], "n": 40, "lens": [(40, 30)] * 3} for s in (1, 2)}
    passed = {"debate": ([], []), "critic": ([], [])}  # the gates' (lines, failed)
    runs = {(a, s): rec(0.8, improvement=0.7) if a == "counterfactual" else rec(0.4)
            for a in ("counterfactual", "plain") for s in (1, 2)}
    text = "\n".join(arm_lines(runs, kept, cli, passed))
    for what in ("the debate against the vote", "the debate against the best generator",
                 "counterfactual against plain critics", "the improvement rate"):
        assert f"## Verdict, {what}: shown" in text, what
    assert "seed 1: 0.700 against 0.100 (+0.600" in text and "28 problems)" in text  # the 28 whose vote is wrong
    runs = {(a, s): rec(0.45, gens=(0.5, 0.3, 0.3)) for a in ("counterfactual", "plain") for s in (1, 2)}
    text = "\n".join(arm_lines(runs, kept, cli, passed))
    assert "## Verdict, the debate against the vote: partly shown" in text  # above on both seeds, inside the noise
    assert "## Verdict, the debate against the best generator: not shown" in text  # below generator 0's 0.5
    assert "## Verdict, counterfactual against plain critics: not shown" in text  # equal
    broken = {**kept, 2: {**kept[2], "gens": [0.0, 0.0, 0.3]}}  # seed 2's Stage 1 did not keep its generators
    text = "\n".join(arm_lines({(a, s): rec(0.8) for a in ("counterfactual", "plain") for s in (1, 2)}, broken, cli,
                               {"debate": ([], []), "critic": ([], ["power, detectable 0.206 > needed 0.008"])}))
    assert "## Verdict, the debate against the vote: premise fails (Stage 1 did not keep the generators on seed 2); " \
           "the rule alone: shown" in text
    assert "## Verdict, counterfactual against plain critics: untestable here: power, detectable 0.206 > needed " \
           "0.008 (the rule alone: not shown)" in text
    half = {k: v for k, v in runs.items() if k != ("plain", 2)}
    assert "Incomplete: seeds finished [1] of [1, 2]" in "\n".join(arm_lines(half, kept, cli, passed))


def test_mada_report_stops_where_the_stage_1_premise_fails():
    from benchmarks.claims.mada_rl_smollm2 import report

    cli = types.SimpleNamespace(num_eval_problems=40, agent_steps=10, seeds=[1, 2], num_prompts=4, group_size=8,
                                max_new_tokens=64, num_train_problems=360, start="base", model="smollm2-135m-instruct")
    cell = lambda lv, t, a: {"level": lv, "temperature": t, "accuracy": a, "mixed": 0.1, "cut": 0.0,  # noqa: E731
                             "held_out": 20 * lv, "problems": 40, "samples": 8, "seconds": 60.0}
    critic = lambda lv, one: {f"L{lv}": 0.2, f"L{lv}, 1 of 3 proposals right": 0.2,  # noqa: E731
                              f"L{lv}, 0 of 3 proposals right": 0.05, f"L{lv}, 1 of 3 responses right": one,
                              f"L{lv}, 0 of 3 responses right": 0.0}
    held = {1: critic(1, 0.4), 2: critic(2, 0.4)}  # 1 of 3 right lifts both levels by 0.40
    sampled = {"L1 T1": cell(1, 1.0, 0.1), "L2 T1": cell(2, 1.0, 0.05)}
    text = report(cli, sampled, None, {}, None, {}, held, {}, [])
    assert "## Verdict: premise fails (Stage 1): no level whose critic premise holds (level 1, " \
           "level 2) gives a sampled accuracy in [0.20, 0.80] at any temperature tried (L1 T1 0.100, L2 T1 0.050)" \
           in text
    assert "Not reached: the premise fails first (below)." in text and "Not yet" not in text
    assert text.index("## The gate") < text.index("## The critic premise") < text.index("## The Stage-1 premise") \
        < text.index("## Verdict")
    text = report(cli, sampled, None, {}, None, {}, {1: critic(1, 0.05), 2: critic(2, 0.0)}, {}, [])
    assert "## Verdict: premise fails (on no level do the critics use a right proposal): no arm ran." in text
    assert "## The Stage-1 premise" not in text  # nothing sampled: the critics could not use what Stage 1 trains
    sampled["L1 T1"]["accuracy"] = 0.4
    probe = lambda *g: {"base": 0.55, "gens": list(g), "n": 20, "lens": [(20, 2)] * 3, "seconds": 600.0}  # noqa: E731
    text = report(cli, sampled, "L1 T1", {1e-4: probe(0.1, 0.0, 0.0), 3e-4: probe(0.0, 0.0, 0.0)}, None, {}, held,
                  {}, [])
    assert "## Verdict: premise fails (Stage 1): no learning rate keeps the generators at or " \
           "above the base model after Stage 1 (0.0001: 0.100 / 0.000 / 0.000 against 0.550; 0.0003: " in text
    assert "## The arms" not in text


def ppo_record(start=0.6, final=0.6, steps=40, stop=None, win_rm=0.5, win_verifier=0.5, **first):
    """A hand-made ppo_slm.py record: the held-out evaluation at step 0 (`first` adds to it), `stop or steps` PPO steps
    (policy entropy 0.016 throughout) and the final evaluation."""
    ev = lambda acc, **kw: {"eval/greedy_accuracy": acc, "eval/sampled_accuracy": acc, "eval/rm_score": 2.0,  # noqa
                            "eval/entropy": 0.016, "eval/win_rate_rm": 0.5, "eval/win_rate_verifier": 0.5, **kw}
    last = stop or steps
    return {"args": {"total_steps": steps, "learning_rate": 2e-4}, "seconds": 60.0, "measured": {},
            "rows": [{"step": 0, "time": 1.0, **ev(start), **first},
                     *({"step": s, "reward/mean": 0.0, "policy/kl_ref": 0.1, "safety/max_ratio": 1.5,
                        "safety/ratio_guard_skips": 0, "rm/score_std": 0.7, "policy/entropy": 0.016}
                       for s in range(1, last + 1)),
                     {"step": last, "time": 9.0, **ev(final), "eval/win_rate_rm": win_rm,
                      "eval/win_rate_verifier": win_verifier}]}


def ppo_rm(answer, step, train=0.9):
    """The step-0 figures of a reward model: held-out pair accuracy by kind, and on its training pairs."""
    return {"rm/pair_accuracy": (110 * answer + 90 * step) / 200, "rm/pair_accuracy/answer": answer,
            "rm/pair_accuracy/step": step, "rm/train_pair_accuracy": train, "rm/train_pair_accuracy/answer": train,
            "rm/train_pair_accuracy/step": train}


PPO_CLI = types.SimpleNamespace(num_eval_prompts=160, num_eval_pairs=200, steps=40, sft_steps=60, rm_steps=150,
                                seeds=[1, 2])
PPO_KINDS = {"answer": 110, "step": 90}


def ppo_report(probe_figures, runs=None, entropy=0.016, naive=None, fix=None, curve=None, frozen=None):
    from benchmarks.claims import ppo_slm_smollm2 as ppo_bench

    stages = ppo_record(**ppo_rm(*probe_figures[0]), **{"time/stages": 3600.0})
    stages["rows"][0]["eval/entropy"] = entropy
    stages["measured"] = {"likelihood": 0.87, "likelihood/answer": 0.94, "likelihood/step": 0.76}
    probe = [(name, types.SimpleNamespace(rm_steps=150, num_train_examples=500, rm_lora_r=16),
              stages if i == 0 else ppo_record(**ppo_rm(*fig)))
             for i, ((name, *_), fig) in enumerate(zip(ppo_bench.RM_PROBE, probe_figures))]
    for _, _, rec in probe[1:]:
        rec["measured"] = {"rm_loss_curve": curve, "rm_loss_window": 25} if curve else {}
    return ppo_bench.report(PPO_CLI, stages, probe, PPO_KINDS, naive, fix, runs or {}, 0.7, frozen)


def test_ppo_report_opens_with_the_gate_and_no_outcome_without_an_rm_that_tells_a_wrong_answer():
    text = ppo_report([(0.491, 1.0)])  # the last design's RM: chance on the answer kind; the probe goes on
    paragraphs = text.split("\n\n")
    assert paragraphs[2].startswith("## The gate") and "- reward model (outcome)" in paragraphs[3]
    assert "Gate: outcome: pending (the RM probe); collapse: untestable here: budget, 40 steps lose at most " in text
    text = ppo_report([(0.491, 1.0), (0.6, 0.7), (0.7, 0.6)])  # none has both kinds beyond the noise
    assert "Gate: outcome: untestable here: no RM this ground trains tells a wrong answer (3 tried: stages: answer " \
           "0.491 (110 pairs, needs > 0.632)" in text
    assert "Not run. Verdict, outcome: untestable here: no RM this ground trains" in text
    text = ppo_report([(0.491, 1.0), (0.7, 0.66)])
    assert "pass (rm_x4_one_pass)" in text and "Gate: outcome: passes;" in text and "Chosen: rm_x4_one_pass." in text
    assert "Verdict, bfloat16: needs a GPU." in text
    assert "| rm_x4_one_pass | 150 | 500 | 16 | 0.693 -> 0.512 (25 steps) | 0.682 (answer 0.700" in \
        ppo_report([(0.491, 1.0), (0.7, 0.66)], curve=[0.6931, 0.6, 0.5123])  # the loss curve the RM's folder kept
    assert "| stages | 150 | 500 | 16 | not kept | " in text


def test_ppo_report_says_whether_the_frozen_backbone_carries_a_wrong_answer_where_no_rm_does():
    none = [(0.491, 1.0), (0.49, 0.48), (0.5, 0.5)]

    def frozen(answer_eos, step_eos):
        figures = {"read": (0.52, 0.47), "eos": (answer_eos, step_eos), "mean": (0.55, 0.5)}
        return {"frozen/train_pairs": 2000,
                **{f"frozen/{k}": (a * 110 + s * 90) / 200 for k, (a, s) in figures.items()},
                **{f"frozen/fit/{k}": 0.6 for k in figures},
                **{f"frozen/{k}/{c}": v for k, fig in figures.items() for c, v in zip(("answer", "step"), fig)}}

    text = ppo_report(none, frozen=frozen(0.55, 0.6))  # the eos is above chance on both kinds, inside the noise
    assert "Why none: the best linear score head on the SFT backbone's frozen last-layer states (`frozen_readout`: " \
           "Bradley-Terry on 2000 training pairs), held-out pair accuracy where it reads: the token a score head " \
           "reads: 0.497 (answer 0.520, step 0.470; 0.600 on its training pairs)" in text
    assert "Above chance beyond the RM rule's margin: answer: nowhere; step: nowhere. So the answer and step kinds " \
           "are not linearly in the untrained backbone's states where a score head reads; its likelihood tells it on " \
           "0.940, 0.760 of those pairs." in text
    text = ppo_report(none, frozen=frozen(0.70, 0.66))  # beyond it on both (needs 0.632 and 0.645)
    assert "answer: the eos; step: the eos. So the backbone carries every kind at some read" in text
    text = ppo_report(none, frozen=frozen(0.50, 0.66))  # a wrong step at the eos, a wrong answer nowhere
    assert "answer: nowhere; step: the eos. So the answer kind is not linearly" in text
    assert "The score head alone" not in text  # a record without it
    recipe = {"frozen/recipe_head": 0.455, "frozen/fit/recipe_head": 0.564, "frozen/recipe_head/answer": 0.427,
              "frozen/recipe_head/step": 0.489, "frozen/recipe_head_steps": 600, "frozen/recipe_head_lr": 5e-4,
              "frozen/recipe_head_batch": 16}
    assert "The score head alone, trained on the same states at the read position with the RMs' optimiser (AdamW, " \
           "lr 0.0005, 600 steps of 16 pairs, from transformers' initialisation): 0.455 (answer 0.427, step 0.489; " \
           "0.564 on its training pairs)." in ppo_report(none, frozen={**frozen(0.50, 0.66), **recipe})
    assert "Why none" not in ppo_report(none)  # not measured: no line


def test_ppo_collapse_is_untestable_when_the_steps_cannot_lose_the_entropy_a_collapse_needs():
    from benchmarks.claims import ppo_slm_smollm2 as ppo_bench

    # the committed last design's noisy runs lose about 1e-5 nats a step: 40 steps cannot take half of 0.016
    assert "Not run. Verdict, collapse: untestable here: budget, 40 steps lose at most 0.0021 of the entropy, a " \
           "collapse needs 0.0080 (153 steps)." in ppo_report([(0.7, 0.7)], entropy=0.016)
    assert "collapse: passes" in ppo_report([(0.7, 0.7)], entropy=0.002)  # a policy with little to lose can
    falling = {"args": {"learning_rate": 2e-4}, "rows": [{"step": s, "reward/mean": 0.0, "policy/entropy": 0.02 -
                                                          0.0004 * s} for s in range(1, 41)]}
    loss, se = ppo_bench.entropy_slopes([falling, falling])
    assert ppo_bench.collapse_budget(0.016, loss, se, 40, 2e-4)["can"]  # 0.016 lost in 40 steps
    assert not ppo_bench.collapse_budget(0.016, loss, se, 10, 2e-4)["can"]  # 0.004 in 10


def test_ppo_collapse_is_half_the_runs_start_or_an_early_stop():
    from benchmarks.claims.ppo_slm_smollm2 import collapsed

    assert not collapsed(ppo_record(0.6, 0.31), 40)
    assert collapsed(ppo_record(0.6, 0.29), 40)  # below half of 0.6
    assert collapsed(ppo_record(0.6, 0.6, stop=12), 40)  # stopped early (rollback limit or KL)
    assert not collapsed(ppo_record(0.5, 0.3), 40)  # each run against its own start (seeds draw their own problems)


def test_ppo_collapse_verdict_waits_for_both_seeds_and_needs_the_off_arm_to_collapse_on_each():
    def verdict(runs):
        text = ppo_report([(0.7, 0.7)], runs, entropy=0.002)  # an entropy the budget can take
        return [line for line in text.split("\n") if "collapse (" in line or "noisy runs" in line][0]

    on = ppo_record(0.762, 0.775)
    runs = {("noisy_on", 1): on, ("noisy_off", 1): ppo_record(0.762, 0.2)}
    assert verdict(runs).startswith("Incomplete: seeds with both noisy runs [1] of [1, 2]")
    both = {**runs, ("noisy_on", 2): on, ("noisy_off", 2): ppo_record(0.762, 0.762, stop=12)}
    assert "collapse (seeds [1, 2]): shown" in verdict(both) and "stopped at step 12" in verdict(both)
    mixed = {**runs, ("noisy_on", 2): on, ("noisy_off", 2): ppo_record(0.762, 0.76)}
    assert "collapse (seeds [1, 2]): not shown" in verdict(mixed)  # off collapsed on one seed only
    lower = {("noisy_on", s): on for s in (1, 2)} | {("noisy_off", s): ppo_record(0.762, 0.55) for s in (1, 2)}
    assert "partly shown" in verdict(lower)  # no collapse; 0.775 against 0.550 beyond the noise on both


def test_ppo_outcome_is_judged_by_the_verifier_as_well_as_by_the_rm():
    def verdict(*seeds):
        runs = {("ppo", s): ppo_record(*acc, win_rm=w, win_verifier=v) for s, (acc, w, v) in enumerate(seeds, 1)}
        return [line for line in ppo_report([(0.7, 0.7)], runs).split("\n") if "Verdict, outcome" in line][0]

    good = ((0.6, 0.75), 0.62, 0.55)  # RM win rate beyond the noise (+-0.077 at 160 prompts), accuracy up
    assert verdict(good, good).startswith("Verdict, outcome: shown (RM win rates 0.620, 0.620, noise +-0.077); by "
                                          "the verifier: greedy accuracy up beyond the noise on every seed")
    fell = ((0.6, 0.4), 0.62, 0.5)  # the RM prefers it; the verifier sees greedy accuracy fall beyond the noise
    assert "Verdict, outcome: partly shown" in verdict(good, fell) and "accuracy down beyond the noise" in \
        verdict(good, fell)
    assert "Verdict, outcome: not shown" in verdict(((0.6, 0.6), 0.49, 0.5), ((0.6, 0.6), 0.55, 0.5))
    same = ((0.6, 0.6), 0.62, 0.45)  # verifier win rate below 0.5 inside its noise (+-0.077): no harm
    assert verdict(same, same).startswith("Verdict, outcome: shown (") and "no change beyond the noise" in \
        verdict(same, same)
    worse = ((0.6, 0.6), 0.62, 0.40)  # below 0.5 beyond the noise: harm, though greedy accuracy held
    assert "Verdict, outcome: partly shown" in verdict(same, worse)
    assert "up beyond the noise on one seed only" in verdict(good, same)


def test_the_ppo_gate_reads_each_seeds_own_start_once_its_arm_is_recorded():
    text = ppo_report([(0.491, 1.0), (0.7, 0.66)])  # before the arms: the stages' start (seed 1's problems)
    assert "the SFT policy (every run's start; seed 1's problems), on 160 held-out level-3 prompts: 0.600 / 0.600 " \
           "(seeds 1 / 2)" in text
    runs = {("ppo", 1): ppo_record(0.6, 0.7, win_rm=0.6, **ppo_rm(0.7, 0.66)),
            ("ppo", 2): ppo_record(0.95, 0.95, win_rm=0.6, **ppo_rm(0.58, 0.71))}
    text = ppo_report([(0.491, 1.0), (0.7, 0.66)], runs)  # seed 2's own problems leave no headroom
    assert "(every run's start; each seed's own problems), on 160 held-out level-3 prompts: 0.600 / 0.950 " in text
    assert "Gate: outcome: untestable here: headroom" in text
    assert "on each seed's own pairs (seed 1's chose it): seed 1: answer 0.700, step 0.660; seed 2: answer 0.580, " \
           "step 0.710." in text


def test_a_report_from_the_records_never_runs(tmp_path):
    args, calls = args_in(tmp_path), []
    try:
        claim_runs.finished_run(fake_trainer(calls), args, str(tmp_path / "rec"), make=False)
        raise AssertionError("no record, no run: expected a one-line error")
    except SystemExit as e:
        assert str(e).startswith("error: r: no record of a run with these arguments")
    assert calls == [] and not os.path.exists(tmp_path / "runs")
    claim_runs.finished_run(fake_trainer(calls), args, str(tmp_path / "rec"))  # made and recorded
    assert claim_runs.finished_run(fake_trainer(calls), args, str(tmp_path / "rec"), make=False)["rows"]
    assert calls == [""]  # once, by the call allowed to run



def test_the_sec_claim_keeps_its_runs_as_records_and_reports_from_them_alone(tmp_path, monkeypatch):
    # rloo_sec_smollm2 once kept its runs only in their folders, and lost them with an old checkout (issue 61)
    import sys

    import rloo_sec
    from benchmarks.claims import rloo_sec_smollm2 as sec

    records, levels = tmp_path / "rec", sec.LEVELS
    records.mkdir()
    for seed in (1, 2):  # the base model's start on the judged level, measured before (the gate reads it)
        start = {"eval/greedy_accuracy": 0.3, "sampled": 0.2, "distinct": 2, "ground": claim_runs.GROUND,
                 "settings": {"level": 2, "n": 2, "seed": seed, "max_new_tokens": 48, "sampled": [2, 4]}}
        (records / f"start_seed{seed}.json").write_text(json.dumps(start))

    def trainer(a):  # leaves the run folder rloo_sec.main leaves: args.json, the metric rows, a checkpoint
        calls.append(a.run_name)
        run_dir = os.path.join(a.output_dir, a.run_name)
        os.makedirs(os.path.join(run_dir, "checkpoint"))
        with open(os.path.join(run_dir, "args.json"), "w") as f:
            json.dump(json.loads(json.dumps(dataclasses.asdict(a))), f)
        ev = lambda step, acc: {"step": step, "time": 1.0 + step, "eval/greedy_accuracy": acc,  # noqa: E731
                                **{f"eval/greedy_accuracy/level_{k}": acc for k in levels}}
        live = 0.75 if a.curriculum == "label" else 0.25  # the share of a step's prompts drawn from level 2
        steps = [{"step": s, "time": 1.0 + s, "reward/mean": 0.5, "perf/step_time": 60.0, "adv/frac_zero_std": 0.5,
                  **{f"sec/level_frac/level_{k}": live if k == 2 else (1 - live) / 2 for k in levels},
                  **{f"sec/prob/arm_{k}": 1 / 3 for k in levels}, "sec/count/arm_2": 4 * live,
                  "sec/success/arm_2": 0.25, "sec/mean_abs_adv/arm_2": 0.375} for s in (1, 2)]
        with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in [ev(0, 0.3), *steps, ev(2, 0.4 + a.seed / 10)])

    def bench(*flags):
        monkeypatch.setattr(sys, "argv", ["rloo_sec_smollm2", "--start", "base", "--learning-rate", "2e-5",
                                          "--steps", "2", "--num-eval-problems", "2",
                                          "--judge-problems", "2", "--records", str(records),
                                          "--output-dir", str(tmp_path / "runs"), "--out", str(tmp_path / "sec.md"),
                                          "--plot", str(tmp_path / "sec.png"), *flags])
        sec.main()
        return (tmp_path / "sec.md").read_text()

    calls, judged = [], []
    monkeypatch.setattr(rloo_sec, "main", trainer)
    monkeypatch.setattr(sec, "level2", lambda path, n, seed: judged.append(path) or {  # the final weights' judging
        "eval/greedy_accuracy": 0.5 + seed / 10, "distinct": n})
    made = bench()
    assert sorted(calls) == ["sec_seed1", "sec_seed2", "uniform_seed1", "uniform_seed2"] and len(judged) == 4
    assert sorted(p.name for p in records.iterdir() if not p.name.startswith("start")) == [
        "sec_seed1.json", "sec_seed2.json", "uniform_seed1.json", "uniform_seed2.json"]
    assert "| uniform | 2 | 0.300 -> 0.700 | 0.300 -> 0.600 |" in made and "## Verdict: untestable here" in made
    assert "| 0.250 | 0.375 | 0.500 |" in made  # level 2's sampled success and its arm reward, as training met them
    assert "| SEC | 1 | 2 | 0.75 | 0.750 |" in made  # the levels each arm drew, from the rows
    assert "`python rloo_sec.py --model-name smollm2-135m-instruct --dataset testbed-nl --levels 2 3 5" in made
    os.rename(tmp_path / "runs", tmp_path / "gone")  # a new session's checkout: no run folders
    day = lambda text: re.sub(r"\d{4}-\d{2}-\d{2}", "<date>", text)  # noqa: E731 - a run past midnight
    assert day(bench("--report-only")) == day(made) and len(calls) == 4  # the same report from the records alone
    assert day(bench("--gate-only")) == day(made) and len(calls) == 4  # the gate, and the runs from their records
    bench()
    assert len(calls) == 4 and len(judged) == 4  # a rerun reads the records back, judged results and all


# --- the gate before a claim run (claim_runs.Claim, gate) ----------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_tok(smollm2_dir):
    from common.models import load_tokenizer

    return load_tokenizer(smollm2_dir)


def clean_claim(**changed) -> claim_runs.Claim:
    return claim_runs.Claim(**{"split": "held-out level 2", "n": 400, "seeds": [1, 2], "start": {1: 0.40, 2: 0.35},
                               "start_is": "greedy accuracy", "effect": 0.10, "effect_is": "plausible", **changed})


def test_the_answer_is_found_as_a_whole_number_of_tokens_never_inside_another(smollm2_tok):
    said = lambda text, answer="68": claim_runs.states_answer(text, answer, smollm2_tok)  # noqa: E731
    assert said("79 - 11 = 68.") and said("The answer is 68") and said("68 apples") and said("(68)")
    assert not said("79 - 11 = 168.") and not said("681 + 2") and not said("6.8 or 0.68") and not said("1,068")
    assert not said("Add the tens: 70 + 10 = 80.") and said("so 8 + 0 = 8.", "8") and not said("18 + 0", "8")


def test_the_gate_passes_a_clean_claim(smollm2_tok):
    leaks = claim_runs.leakage([("Add the tens: 70 + 10 = 80.", "86"), ("Buying more means adding.", "86")],
                               smollm2_tok)
    lines, failed = claim_runs.gate(clean_claim(), leaks)
    assert failed == [] and len(lines) == 3 and all(line.endswith(": pass") for line in lines)
    assert [line.split(":")[0] for line in lines] == ["- leakage", "- headroom", "- power"]


def test_the_gate_fails_a_leaking_hint(smollm2_tok):
    leaks = claim_runs.leakage([("79 - 11 = 68.", "68"), ("Buying more means adding.", "68")], smollm2_tok)
    _, failed = claim_runs.gate(clean_claim(), leaks)
    assert failed == ["leakage, 1 of 2 added contexts state the answer"]
    assert claim_runs.untestable(failed) == "untestable here: leakage, 1 of 2 added contexts state the answer"


def test_the_gate_fails_a_control_at_the_floor_or_the_ceiling():
    none = {"leaks": 0, "contexts": 0}
    for start in ({1: 0.0, 2: 0.025}, {1: 0.5, 2: 0.95}):
        _, failed = claim_runs.gate(clean_claim(start=start), none)
        assert [f.split(",")[0] for f in failed] == ["headroom"], failed


def test_the_gate_fails_a_powerless_n_or_a_single_seed():
    none = {"leaks": 0, "contexts": 0}
    _, failed = claim_runs.gate(clean_claim(n=40), none)  # 40 problems detect 0.22 from 0.375, not 0.10
    assert failed == ["power, detectable 0.220 > needed 0.100"]
    assert claim_runs.gate(clean_claim(seeds=[1]), none)[1] == ["power, 1 seed"]
    # a fall from the start (a collapse) and a rate against a fixed 0.5 are measured the same way
    assert claim_runs.gate(clean_claim(n=80, start={1: 0.76, 2: 0.76}, effect=0.38, fall=True), none)[1] == []
    assert claim_runs.gate(clean_claim(n=80, effect=0.08, against=0.5), none)[1] == [
        "power, detectable 0.110 > needed 0.080"]


def test_a_record_of_another_testbed_nl_version_is_reported_but_never_reused_for_a_run(tmp_path):
    args, calls = args_in(tmp_path), []
    rec = claim_runs.finished_run(fake_trainer(calls), args, str(tmp_path / "rec"))
    assert rec["ground"] == claim_runs.GROUND and calls == [""]
    path = tmp_path / "rec" / "r.json"
    old = {k: v for k, v in json.loads(path.read_text()).items() if k != "ground"}  # a record made before versions
    path.write_text(json.dumps(old))
    assert claim_runs.finished_run(fake_trainer(calls), args, str(tmp_path / "rec"), make=False) == old
    assert claim_runs.records_ground(str(tmp_path / "rec")) == 1
    claim_runs.finished_run(fake_trainer(calls), args, str(tmp_path / "rec"))  # run again: its folder is recorded
    assert json.loads(path.read_text())["ground"] == claim_runs.GROUND
    measured = []
    cell = tmp_path / "cell.json"
    cell.write_text(json.dumps({"x": 1, "settings": {"n": 4}}))  # a measurement of version 1
    assert claim_runs.cached(str(cell), {"n": 4}, lambda: measured.append(1) or {"x": 2}, make=False)["x"] == 1
    assert claim_runs.cached(str(cell), {"n": 4}, lambda: measured.append(1) or {"x": 2})["x"] == 2
    assert measured == [1]


def test_a_growing_record_measures_only_the_cells_it_lacks(tmp_path):
    """cached(grow=True), as the MADA premise uses it when a temperature is added to the candidates."""
    path, asked = str(tmp_path / "cells.json"), []

    def measure(have, want=("a", "b")):
        asked.append(sorted(have))
        return {**have, **{k: k.upper() for k in want if k not in have}}

    assert claim_runs.cached(path, {"n": 4}, measure, grow=True)["b"] == "B" and asked == [[]]
    first = os.path.getmtime(path)
    assert claim_runs.cached(path, {"n": 4}, measure, grow=True)["a"] == "A"  # nothing new: the record is not rewritten
    assert asked[-1] == ["a", "b"] and os.path.getmtime(path) == first
    grown = claim_runs.cached(path, {"n": 4}, lambda have: measure(have, ("a", "b", "c")), grow=True)
    assert asked[-1] == ["a", "b"] and grown["c"] == "C" and json.loads(open(path).read())["c"] == "C"
    assert claim_runs.cached(path, {"n": 4}, measure, make=False, grow=True)["c"] == "C"  # a report measures nothing
    assert len(asked) == 3
    assert claim_runs.cached(path, {"n": 5}, measure, grow=True) == {"a": "A", "b": "B", "settings": {"n": 5},
                                                                    "ground": claim_runs.GROUND}  # other settings: anew
