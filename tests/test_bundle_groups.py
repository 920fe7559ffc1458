"""A bundle's `groups` block (docs/METHOD.md section 12): per group name its own lambda* table
(and mu* table in a two-sided bundle). Absent, a bundle is written and read as before (same
bytes, same checksum); present, each group's tables are held to the main tables' rules."""

import json
import math

import pytest

from orca_method.bundle import BundleError, _checksum, load_bundle, save_bundle
from orca_method.bundle_checks import check_semantics
from orca_method.thresholds import GIVE_UP_NEVER
from tests.bundles import small_bundle, with_give_up, with_groups

SHIFTED = {"lam": [(0.05, None), (0.1, 0.95)]}  # the main table: 0.05 never, 0.1 at 0.8


def test_a_bundle_without_groups_is_written_as_before(tmp_path):
    """No `groups` key in the file, so readers that predate the block read it (they refuse an
    unknown key) and its checksum is the one they compute."""
    out = tmp_path / "b.json"
    save_bundle(small_bundle(), out)
    assert "groups" not in json.loads(out.read_text())
    save_bundle(load_bundle(out), tmp_path / "again.json")
    assert (tmp_path / "again.json").read_text() == out.read_text()


def test_groups_round_trip_and_take_their_own_lambda(tmp_path):
    b = with_groups(with_give_up(small_bundle(), [(0.02, None), (0.05, 0.2)]),
                    {"shifted": {**SHIFTED, "mu": [(0.02, None), (0.05, 0.1)]},
                     "in-dist": {"lam": [(0.05, 0.9), (0.1, 0.7)]}})
    out = tmp_path / "g.json"
    save_bundle(b, out)
    loaded = load_bundle(out)
    check_semantics(loaded)
    assert sorted(loaded.groups) == ["in-dist", "shifted"]
    assert loaded.lam(0.1, "shifted") == 0.95 and loaded.lam(0.05, "in-dist") == 0.9
    assert loaded.lam(0.1) == 0.8 and loaded.lam(0.1, "unknown") == 0.8  # the mixture's
    assert loaded.lam(0.05, "shifted") == math.inf
    assert loaded.mu(0.05, "shifted") == 0.1 and loaded.mu(0.05) == 0.2
    # a known group without its own mu* never gives up: the mixture's is not certified for it
    assert loaded.mu(0.05, "in-dist") == GIVE_UP_NEVER
    assert loaded.mu(0.05, "unknown") == 0.2
    with pytest.raises(BundleError, match="no calibrated mu"):
        loaded.mu(0.3, "in-dist")
    with pytest.raises(BundleError, match="no calibrated lambda"):
        loaded.lam(0.3, "shifted")


def _saved(tmp_path, bundle):
    """Seal `bundle` without its checks (save_bundle validates the model only)."""
    out = tmp_path / "bad.json"
    save_bundle(bundle, out)
    return out


@pytest.mark.parametrize("groups, message", [
    ({"g": {"lam": [(0.05, None), (0.05, 0.9), (0.1, 0.8)]}}, "group 'g' lists delta 0.05 twice"),
    ({"g": {"lam": [(0.1, 0.8)]}}, "group 'g' has lambda\\* for deltas \\[0.1\\], the main"),
    ({"g": {"lam": [(0.05, None), (0.1, 0.8), (0.2, 0.5)]}}, "the same deltas"),
    ({"g": {"lam": [(0.05, None), (0.1, 0.8)], "mu": [(0.05, 0.1)]}}, "bundle is one-sided"),
])
def test_bad_group_tables_are_refused_at_load(tmp_path, groups, message):
    with pytest.raises(BundleError, match=message):
        load_bundle(_saved(tmp_path, with_groups(small_bundle(), groups)))


def test_a_group_default_delta_without_lambda_is_refused(tmp_path):
    """The default delta is calibrated in every group: a group table without it is refused."""
    b = with_groups(small_bundle(), {"g": {"lam": [(0.05, None), (0.2, 0.5)]}})
    with pytest.raises(BundleError, match="group 'g' has lambda"):
        load_bundle(_saved(tmp_path, b))


def test_a_group_give_up_table_other_than_the_main_ones_deltas_is_refused(tmp_path):
    b = with_groups(with_give_up(small_bundle(), [(0.02, None), (0.05, 0.2)]),
                    {"g": {**SHIFTED, "mu": [(0.05, 0.1)]}})
    with pytest.raises(BundleError, match="give-up deltas \\[0.05\\], the main table for"):
        load_bundle(_saved(tmp_path, b))


def test_group_tables_are_checked_as_the_main_ones(tmp_path):
    """The semantics checks run on each group's table, named in the refusal: lambda* rising
    with delta, a risk that is not a whole number of losses, mu* falling with delta_2."""
    rising = with_groups(small_bundle(), {"g": {"lam": [(0.05, 0.5), (0.1, 0.9)]}})
    with pytest.raises(BundleError, match="^group 'g': lambda\\* rises with delta"):
        check_semantics(load_bundle(_saved(tmp_path, rising)))
    ok = with_groups(small_bundle(), {"g": SHIFTED})
    table = ok.groups["g"].ltt
    odd = table.model_copy(update={"rows": [
        r.model_copy(update={"risk": 0.013}) if r.lam is not None else r for r in table.rows]})
    edited = ok.model_copy(update={"groups": {"g": ok.groups["g"].model_copy(
        update={"ltt": odd})}})
    with pytest.raises(BundleError, match="^group 'g': delta 0.1 .* not a whole number"):
        check_semantics(load_bundle(_saved(tmp_path, edited)))
    falling = with_groups(with_give_up(small_bundle(), [(0.02, None), (0.05, 0.2)]),
                          {"g": {**SHIFTED, "mu": [(0.02, 0.3), (0.05, 0.1)]}})
    with pytest.raises(BundleError, match="^group 'g': give-up mu\\* falls"):
        check_semantics(load_bundle(_saved(tmp_path, falling)))


def test_summary_names_the_groups(tmp_path):
    b = load_bundle(_saved(tmp_path, with_groups(small_bundle(), {"shifted": SHIFTED})))
    assert b.summary()["groups"]["shifted"]["ltt"]["n_cal"] == 60


def test_a_group_with_an_empty_name_is_refused(tmp_path):
    """A group's name is what a request's `orca.group` says: never empty."""
    out = _saved(tmp_path, with_groups(small_bundle(), {"g": SHIFTED}))
    data = json.loads(out.read_text())
    data["groups"] = {"": data["groups"]["g"]}
    data["checksum"] = _checksum(data)
    out.write_text(json.dumps(data))
    with pytest.raises(BundleError, match="invalid at 'groups"):
        load_bundle(out)
