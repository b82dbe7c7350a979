"""Copy task: the Perceiver IO kind, and the tree-design / reward / λ ablations of the tca kind."""
import json

import pytest
import torch

from attn_ext import tree_num_selected
from bench.__main__ import main
from bench.np.tasks.copy import CopyConfig, _loss, build_model, copy_batch, rl_reward, train
from bench.np.tasks.copy_models import TREE_DESIGNS, grid_coords

QUIET = dict(log=lambda m: None)


def _leaf_positions(design, seq_len=32, batch=3, seed=0):
    """``[batch, N/2]`` context positions in leaf order under ``design``."""
    torch.manual_seed(seed)
    model = build_model(CopyConfig(seq_len=seq_len, dim=16, tree_design=design))
    context, query_pos, _ = copy_batch(batch, seq_len, torch.Generator().manual_seed(seed))
    state, _ = model.encode(context, query_pos, torch.Generator().manual_seed(seed + 1))
    return state.tree.leaf_token[:, : seq_len // 2]


def test_perceiver_trains_and_reads_its_latents(tmp_path, capsys):
    cfg = CopyConfig(seq_len=32, kind="perceiver", steps=3, eval_size=16, log_every=3, dim=16)
    model = build_model(cfg)
    assert cfg.tokens_read() == tree_num_selected(16, 2) == model.latents.shape[0] == 5
    params = [p.detach().clone() for p in model.parameters()]
    loss, _ = _loss(model, cfg, torch.Generator().manual_seed(0))
    loss.backward()
    torch.optim.Adam(model.parameters(), lr=1e-2).step()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(params, model.parameters()))
    r = train(CopyConfig(seq_len=32, kind="perceiver", latents=3, steps=2, eval_size=16, log_every=2, dim=16), **QUIET)
    assert (r["read"], r["latents"], r["context"]) == (3, 3, 16) and 0 <= r["accuracy"] <= 1
    assert main(["train", "copy", "--seq-len", "16", "--steps", "2", "--eval-size", "16", "--dim", "16",
                 "--model", "perceiver", "--latents", "6", "--out", str(tmp_path)]) == 0
    stored = json.loads((tmp_path / "copy_perceiver.json").read_text())
    assert stored["read"] == stored["latents"] == 6 and stored["fraction_read"] == 6 / 8
    assert "tokens read per query 6/8" in capsys.readouterr().out


def test_perceiver_queries_attend_over_the_latents_only():
    torch.manual_seed(0)
    model = build_model(CopyConfig(seq_len=16, kind="perceiver", latents=4, dim=16)).eval()
    seen = []
    model.read_out.register_forward_hook(lambda mod, args, out: seen.append(tuple(args[1].shape)))
    context, query_pos, _ = copy_batch(2, 16, torch.Generator().manual_seed(0))
    logits = model(context, query_pos)
    assert logits.shape == (2, 8, 12) and seen == [(2, 4, 16)]  # keys: the 4 latents, not the 8 tokens
    assert not torch.allclose(model(context.flip(1), query_pos), logits)  # the latents carry the context


def test_tree_designs_order_the_leaves():
    position, random_order = _leaf_positions("position"), _leaf_positions("random")
    assert torch.equal(position, torch.arange(16).expand(3, 16))
    assert not torch.equal(random_order, position) and not torch.equal(random_order[0], random_order[1])
    assert torch.equal(random_order.sort(dim=1).values, position)  # a permutation of the context
    rows_cols = grid_coords(16)  # 4 x 4 grid: position p -> (p // 4, p % 4)
    for design, axis in (("kd-x0", 0), ("kd-x1", 1)):
        leaves = _leaf_positions(design)
        coord = rows_cols[leaves, axis]
        assert (coord.diff(dim=1) >= 0).all(), design  # sorted on that axis ...
        other = rows_cols[leaves, 1 - axis].view(3, 4, 4)
        assert not (other.diff(dim=-1) >= 0).all(), design  # ... and nothing below it
    rp = _leaf_positions("kd-rp")
    assert torch.equal(rp[0], rp[1]) and not torch.equal(rp[0], position[0])  # a fixed order, not the sequence's


def test_accuracy_reward_is_zero_one_and_neg_ce_matches_float64():
    torch.manual_seed(0)
    logits, target = torch.randn(4, 6, 12), torch.randint(0, 12, (4, 6))
    acc = rl_reward(logits, target, "accuracy")
    assert set(acc.unique().tolist()) <= {0.0, 1.0} and torch.equal(acc, (logits.argmax(-1) == target).float())
    expected = torch.log_softmax(logits.double(), -1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(rl_reward(logits, target, "neg-ce").double(), expected)
    assert not rl_reward(logits.requires_grad_(), target, "neg-ce").requires_grad


def test_reward_and_lambda_change_the_loss():
    def loss(**kw):
        cfg = CopyConfig(seq_len=16, dim=16, batch=8, **kw)
        torch.manual_seed(0)
        model = build_model(cfg)
        return _loss(model, cfg, torch.Generator().manual_seed(0))[0].item()

    base, no_rl, big_rl = loss(), loss(lambda_rl=0.0), loss(lambda_rl=10.0)
    assert base != no_rl and big_rl == pytest.approx(no_rl + 10 * (base - no_rl), rel=1e-4, abs=1e-5)
    assert loss(reward="neg-ce") != base
    no_ca = loss(lambda_ca=0.0)
    assert no_ca < base  # the full-attention cross entropy, a positive term, is dropped


def test_ablation_flags_reach_the_result_json(tmp_path, capsys):
    assert main(["train", "copy", "--seq-len", "16", "--steps", "2", "--eval-size", "16", "--dim", "16",
                 "--tree-design", "kd-x1", "--reward", "neg-ce", "--lambda-rl", "0.1", "--lambda-ca", "10",
                 "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "copy_tca.json").read_text())
    assert (r["tree_design"], r["reward"], r["lambda_rl"], r["lambda_ca"]) == ("kd-x1", "neg-ce", 0.1, 10.0)
    assert "[tree kd-x1, reward neg-ce" in capsys.readouterr().out
    # both: the tca options go to tca only, so ca still trains
    assert main(["train", "copy", "--seq-len", "16", "--steps", "1", "--eval-size", "16", "--dim", "16",
                 "--model", "both", "--tree-design", "random", "--out", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "copy_ca.json").read_text())["tree_design"] == "position"


@pytest.mark.parametrize("kwargs, match", [
    (dict(tree_design="sorted"), "tree_design must be one of"),
    (dict(reward="ce"), "reward must be one of"),
    (dict(lambda_rl=-1.0), "lambda_rl must be a finite number"),
    (dict(lambda_ca=float("inf")), "lambda_ca must be a finite number"),
    (dict(kind="perceiver", latents=0), "latents must be a positive int"),
    (dict(kind="ca", tree_design="random"), "tree_design only apply to kind 'tca'"),
    (dict(kind="perceiver", reward="neg-ce"), "reward only apply to kind 'tca'"),
    (dict(kind="tca", latents=4), "latents and perceiver_layers only apply to kind 'perceiver'"),
    (dict(kind="perceiver", perceiver_layers=0), "steps, .* must be positive"),
])
def test_bad_settings_raise(kwargs, match):
    with pytest.raises(ValueError, match="copy task: " + match):
        CopyConfig(seq_len=16, **kwargs)


def test_bad_flags_fail_on_the_command_line(capsys):
    assert main(["train", "copy", "--seq-len", "16", "--model", "ca", "--tree-design", "random"]) == 1
    assert "only apply to kind 'tca'" in capsys.readouterr().err
    assert main(["train", "copy", "--seq-len", "16", "--lambda-rl", "-2"]) == 1
    with pytest.raises(SystemExit):
        main(["train", "copy", "--tree-design", "sideways"])
    assert set(TREE_DESIGNS) == {"position", "random", "kd-x0", "kd-x1", "kd-rp"}
