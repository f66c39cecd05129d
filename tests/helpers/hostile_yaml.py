"""``replicator.yaml`` files a hostile pod writes to stall its node's agent (issue 48): alias bombs, and
64 KiB documents nested as deep as the size allows."""

from replicator.local_tier.frameworks.client_dir import MAX_REPLICATOR_YAML_BYTES


def alias_bomb(config: str, levels: int) -> str:
    """``config`` (a valid file with a ``nodes:`` line) whose ``nodes`` names, by alias, ``levels``
    levels of lists ten wide: 10**levels items in a few hundred bytes. Today's ``nodes`` is a list where
    an integer belongs, so a loader that takes aliases builds it, and an error message that prints it
    walks all 10**levels items (issue 48: 467 bytes, 10 levels, took 6.7 s)."""
    lines = ["l0: &l0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, levels)]
    body = "".join(
        f"nodes: *l{levels - 1}\n" if line.startswith("nodes: ") else line + "\n" for line in config.splitlines()
    )
    return "\n".join(lines) + "\n" + body


def nested_flow_lists(config: str, size: int = MAX_REPLICATOR_YAML_BYTES) -> str:
    """``config`` and one more key holding flow lists nested as deep as ``size`` bytes allow (about
    32,000 levels on one line)."""
    head = config + "extra: "
    depth = (size - len(head.encode()) - 1) // 2
    return head + "[" * depth + "]" * depth + "\n"


def nested_mappings(config: str, size: int = MAX_REPLICATOR_YAML_BYTES) -> str:
    """``config`` and one more key holding block mappings nested by indentation as deep as ``size``
    bytes allow (about 350 levels, one a line)."""
    text, depth = config + "extra:\n", 1
    while len(text.encode()) + depth + len("k:\n") <= size:
        text += " " * depth + "k:\n"
        depth += 1
    return text
