"""Bundle schema versions: one-sided bundles (version 1) load and are written as before; a
two-sided bundle (a give_up block) is version 2, and a version-1 reader refuses it in one line."""

import json
import math
from pathlib import Path

import pytest

from orca_method.bundle import (
    SCHEMA_VERSION,
    TWO_SIDED_VERSION,
    BundleError,
    load_bundle,
    save_bundle,
)
from orca_method.outcomes import GiveUpPolicy
from orca_method.thresholds import GIVE_UP_NEVER
from tests.bundles import small_bundle, with_give_up

OLD_DEMO = Path(__file__).parent / "data" / "demo-bundle-v1.json"
DEMO = Path(__file__).parent.parent / "orca_serve" / "demo"  # the shipped (two-sided) bundles


def test_a_bundle_written_before_version_2_loads_unchanged():
    """The demo bundle as shipped before two-sided stopping: same lambda*, no give-up, and
    re-written by this code it is byte-identical (same checksum, no give_up key)."""
    raw = OLD_DEMO.read_text()
    data = json.loads(raw)
    assert data["schema_version"] == 1 and "give_up" not in data
    b = load_bundle(OLD_DEMO)
    assert b.schema_version == SCHEMA_VERSION and b.give_up is None
    assert b.checksum == data["checksum"]
    for row in data["ltt"]["rows"]:
        want = math.inf if row["lam"] is None else row["lam"]
        assert b.lam(row["delta"]) == want
    with pytest.raises(BundleError, match="no give-up threshold"):
        b.mu(0.05)
    assert b.load_give_up_probe() is None and b.give_up_deltas() == []


def test_a_one_sided_bundle_is_still_written_as_version_1(tmp_path):
    out = tmp_path / "b.json"
    save_bundle(small_bundle(), out)
    data = json.loads(out.read_text())
    assert data["schema_version"] == 1 and "give_up" not in data
    save_bundle(load_bundle(out), tmp_path / "again.json")
    assert (tmp_path / "again.json").read_text() == out.read_text()


def test_a_two_sided_bundle_is_version_2_and_round_trips(tmp_path):
    b = with_give_up(small_bundle(), [(0.05, 0.2), (0.1, None)])
    out = tmp_path / "two.json"
    save_bundle(b, out)
    data = json.loads(out.read_text())
    assert data["schema_version"] == TWO_SIDED_VERSION == 2
    loaded = load_bundle(out)
    assert loaded.mu(0.05) == 0.2 and loaded.mu(0.1) == GIVE_UP_NEVER
    assert loaded.lam(0.1) == 0.8  # the upper table means what it meant
    probe = loaded.load_give_up_probe()
    assert probe is not None and not probe.spec.online
    assert loaded.summary()["give_up"]["probe"]["variant"] == "static"
    with pytest.raises(BundleError, match="give-up delta 0.2 has no calibrated mu"):
        loaded.mu(0.2)


def test_the_give_up_policy_is_written_only_when_it_is_not_guess(tmp_path):
    """A bundle records the give-up policy its mu* was certified for; "guess" (what every bundle
    from before the field was certified for) is not written, so those bundles, the shipped demo
    bundles included, load as "guess" and are re-written byte-identical (same checksum)."""
    for shipped in (DEMO / "bundle.json", DEMO / "long" / "bundle.json"):
        assert "policy" not in json.loads(shipped.read_text())["give_up"]
        b = load_bundle(shipped)
        assert b.give_up.policy == GiveUpPolicy.GUESS
        save_bundle(b, tmp_path / "again.json")
        assert (tmp_path / "again.json").read_text() == shipped.read_text()
    guess = with_give_up(small_bundle(), [(0.05, 0.2)])
    message = guess.model_copy(update={"give_up": guess.give_up.model_copy(
        update={"policy": GiveUpPolicy.MESSAGE})})
    for b, written in ((guess, None), (message, GiveUpPolicy.MESSAGE)):
        out = tmp_path / f"{b.give_up.policy}.json"
        sealed = save_bundle(b, out)
        assert json.loads(out.read_text())["give_up"].get("policy") == written
        loaded = load_bundle(out)
        assert loaded.give_up.policy == b.give_up.policy == sealed.give_up.policy
        assert loaded.summary()["give_up"]["policy"] == b.give_up.policy  # GET /v1/orca/bundle
        save_bundle(loaded, tmp_path / "again.json")
        assert (tmp_path / "again.json").read_text() == out.read_text()
    assert load_bundle(tmp_path / "message.json").checksum != load_bundle(
        tmp_path / "guess.json").checksum  # the policy is sealed: editing it breaks the checksum


def _edited(tmp_path: Path, bundle, edit) -> Path:
    """`bundle` saved, its JSON edited and re-sealed with a fresh checksum."""
    from orca_method.bundle import _checksum

    out = tmp_path / "edited.json"
    save_bundle(bundle, out)
    data = json.loads(out.read_text())
    edit(data)
    data["checksum"] = _checksum(data)
    out.write_text(json.dumps(data))
    return out


@pytest.mark.parametrize("edit, match", [
    # a version-1 reader's view: a version it does not read is refused before any field
    (lambda d: d.update(schema_version=3), "schema version 3, this orca-serve reads versions 1 "
                                           "and 2"),
    # the version must say what the bundle holds
    (lambda d: d.update(schema_version=1), "schema version 1 with a give_up block"),
    (lambda d: d["give_up"].update(label_mode="consistent"), "needs reference labels"),
    (lambda d: d["give_up"].update(default_delta=0.2), "give_up.default_delta"),
    (lambda d: d["give_up"]["ltt"]["rows"].append(dict(d["give_up"]["ltt"]["rows"][0])),
     "give-up delta 0.05 twice"),
    (lambda d: d["give_up"].update(policy="stop"), r"give_up.policy': must be one of guess, "
                                                   r"message \(got 'stop'\)"),
])
def test_two_sided_bundle_refusals_are_one_line(tmp_path, edit, match):
    path = _edited(tmp_path, with_give_up(small_bundle(), [(0.05, 0.2)]), edit)
    with pytest.raises(BundleError, match=match) as e:
        load_bundle(path)
    assert "\n" not in str(e.value)


def test_version_2_without_a_give_up_block_is_refused(tmp_path):
    path = _edited(tmp_path, small_bundle(), lambda d: d.update(schema_version=2))
    with pytest.raises(BundleError, match="schema version 2 without a give_up block"):
        load_bundle(path)


@pytest.mark.parametrize("rows, match", [
    ([(0.05, 0.3), (0.1, 0.2)], "mu\\* falls as delta_2 rises"),
    ([(0.05, None), (0.1, 0.2)], None),
])
def test_give_up_table_semantics(rows, match):
    from orca_method.bundle_checks import check_semantics

    b = with_give_up(small_bundle(), rows)
    if match is None:
        check_semantics(b)
        return
    with pytest.raises(BundleError, match=match):
        check_semantics(b)


def test_give_up_row_must_match_its_own_risk():
    from orca_method.bundle_checks import check_give_up_rows

    b = with_give_up(small_bundle(), [(0.05, 0.2)])
    row = b.give_up.ltt.rows[0].model_copy(update={"pvalue": 0.01})
    edited = b.give_up.model_copy(update={"ltt": b.give_up.ltt.model_copy(update={"rows": [row]})})
    with pytest.raises(BundleError, match="does not match its own risk"):
        check_give_up_rows(b.model_copy(update={"give_up": edited}))
