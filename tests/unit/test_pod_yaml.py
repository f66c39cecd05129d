"""The bounded YAML loader of pod-written files (``replicator.yaml``): real files load as
``yaml.safe_load`` builds them; alias bombs and deep nesting are refused where they start, for good;
no error message holds more than a short prefix of what the pod wrote."""

import pytest
import yaml

from replicator.local_tier import pod_yaml
from replicator.local_tier.frameworks import InvalidReplicatorConfig
from replicator.local_tier.frameworks.client_dir import MAX_REPLICATOR_YAML_BYTES
from replicator.local_tier.frameworks.orbax import parse_replicator_config
from tests.helpers.hostile_yaml import alias_bomb, nested_flow_lists, nested_mappings

ORBAX_FILE = "job-name: run\nframework: orbax\nassume-data-parallelism: 1\nnode-rank: 0\nnodes: 1\npeer-ranks: []\nbackup-interval-steps: 6\n"


def nested(depth: int) -> str:
    """A mapping holding ``depth - 2`` nested flow lists around one scalar: ``depth`` nodes deep."""
    return "a: " + "[" * (depth - 2) + "1" + "]" * (depth - 2) + "\n"


@pytest.mark.parametrize(
    "text",
    [
        ORBAX_FILE,
        "job-name: run\nframework: orbax\npeer-ranks: [1, 3]\nbackup-interval-minutes: 2.5\n",
        yaml.dump({"job-name": "llama", "framework": "pytorch.distributed", "node-rank": 3, "peer-ranks": [0, 1, 2]}),
        "a: {b: [1, {c: [true, ~, .inf, 2001-01-01]}]}\n",
        nested(pod_yaml.MAX_DEPTH),
        "",
    ],
)
def test_files_without_anchors_load_as_safe_load_builds_them(text):
    assert pod_yaml.load(text) == yaml.safe_load(text)


@pytest.mark.parametrize("levels", range(6, 13))
def test_an_alias_bomb_is_refused_at_its_first_anchor_for_good(levels):
    text = alias_bomb(ORBAX_FILE, levels) + "]]] not: [yaml"  # never read: the refusal comes at line 1
    with pytest.raises(pod_yaml.RefusedYaml) as err:
        pod_yaml.load(text)
    assert str(err.value) == "an anchor ('l0') at line 1, column 5: anchors and aliases are refused"
    assert err.value.final
    # What the agent tells the job, with no word of the 10**levels items.
    with pytest.raises(InvalidReplicatorConfig) as refused:
        parse_replicator_config(alias_bomb(ORBAX_FILE, levels), expected_rank=0, expected_nodes=1)
    assert refused.value.field == "(document)" and refused.value.final
    assert "anchors and aliases are refused" in str(refused.value) and len(str(refused.value)) < 200


@pytest.mark.parametrize(
    "text, where",
    [
        ("a: &x 1\nb: *x\n", "an anchor ('x') at line 1, column 4"),
        ("a: *nowhere\n", "an alias ('nowhere') at line 1, column 4"),
        ("&" + "n" * 5000 + " a: 1\n", f"an anchor ('{'n' * 64}'... (5000 characters)) at line 1, column 1"),
    ],
)
def test_every_anchor_and_alias_is_refused_naming_a_bounded_prefix_of_it(text, where):
    with pytest.raises(pod_yaml.RefusedYaml, match=r"anchors and aliases are refused$") as err:
        pod_yaml.load(text)
    assert str(err.value).startswith(where) and err.value.final


@pytest.mark.parametrize(
    "text, where",
    [
        (nested(pod_yaml.MAX_DEPTH + 1), "line 1, column 11"),
        # libyaml refuses 1,000 flow levels on one line before the composer reads the first ones.
        (nested_flow_lists(ORBAX_FILE), "line 8, column 1007"),
        ("a: " + "{" * 60000, "line 1, column 1003"),
        (nested_mappings(ORBAX_FILE), "line 15, column 8"),
        ("- " * 32000, "line 1, column 17"),
    ],
)
def test_nesting_deeper_than_the_bound_is_refused_where_it_goes_too_deep_for_good(text, where):
    assert len(text.encode()) <= MAX_REPLICATOR_YAML_BYTES
    with pytest.raises(pod_yaml.RefusedYaml) as err:
        pod_yaml.load(text)
    assert str(err.value) == f"nesting deeper than {pod_yaml.MAX_DEPTH} levels at {where}" and err.value.final


@pytest.mark.parametrize(
    "text, problem",
    [
        ("peer-ranks: [1, 2", "expected ',' or ']'"),  # a file still being written
        ("a: 1\n---\nb: 2\n", "expected a single document"),
        ("nodes: " + "9" * 5000, "Exceeds the limit (4300 digits)"),  # PyYAML lets int()'s ValueError through
        ("since: 2001-13-01", "month must be in 1..12"),
        ("x: !!python/object/apply:os.system [true]", "could not determine a constructor"),
    ],
)
def test_any_other_error_is_invalid_yaml_that_a_later_write_may_fix(text, problem):
    with pytest.raises(pod_yaml.RefusedYaml) as err:
        pod_yaml.load(text)
    assert str(err.value).startswith("not valid YAML: ") and problem in str(err.value) and not err.value.final


def test_descriptions_of_pod_values_are_short_and_never_walk_a_structure():
    shared = [0] * 10
    for _ in range(11):
        shared = [shared] * 10  # 10**12 items by reference, as an alias bomb builds them
    assert pod_yaml.describe(shared) == "a list of 10 items"
    assert pod_yaml.describe(list(range(10**6))) == "[0, 1, 2, 3, 4, 5, 6, 7, ...] (1000000 items)"
    assert pod_yaml.describe((3, 1)) == "[3, 1]"
    assert pod_yaml.describe({"k": shared}) == "a mapping of 1 keys"
    assert pod_yaml.describe("x" * 100_000) == repr("x" * 64) + "... (100000 characters)"
    assert pod_yaml.describe(7**4000) == f"an integer of {(7**4000).bit_length()} bits"
    assert pod_yaml.describe(-3) == "-3" and pod_yaml.describe(None) == "None"


@pytest.mark.parametrize(
    "key, value, shown",
    [
        ("framework", "x" * 60000, "60000 characters"),
        ("nodes", "[" + ", ".join(map(str, range(9000))) + "]", "(9000 items)"),
        ("nodes", "{" + ", ".join(f"k{i}: {i}" for i in range(5000)) + "}", "a mapping of 5000 keys"),
        ("nodes", "9" * 4000, "an integer of 13288 bits"),
        ("peer-ranks", "[" + ", ".join(map(str, range(1, 9000))) + "]", "(8999 items)"),
    ],
)
def test_an_invalid_fields_message_names_it_and_shows_a_bounded_prefix_of_its_value(key, value, shown):
    text = ORBAX_FILE.replace(f"\n{key}: ", f"\n{key}: {value}\n{key}-was: ")
    assert len(text.encode()) <= MAX_REPLICATOR_YAML_BYTES
    with pytest.raises(InvalidReplicatorConfig) as err:
        parse_replicator_config(text, expected_rank=0, expected_nodes=1)
    assert err.value.field == key and shown in str(err.value) and not err.value.final
    assert len(str(err.value)) <= 1100
