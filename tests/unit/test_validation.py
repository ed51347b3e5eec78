"""Text, path and size rules of a workload spec, through the wire conversion (as the API sees
them): each refusal names the field and never echoes unbounded input."""

from __future__ import annotations

from typing import Any

import pytest

from orka.api import controller_pb2 as pb
from orka.errors import Invalid
from orka.rpc import convert
from orka.validation import (
    MAX_ARG_LENGTH,
    MAX_ARGS,
    MAX_ENV_ENTRIES,
    MAX_ENV_VALUE_LENGTH,
    MAX_SELECTOR_ENTRIES,
    MAX_SPEC_BYTES,
    check_path,
    path_within,
    quote,
    reserved_labels,
)


def spec_pb(**overrides: Any) -> pb.WorkloadSpec:
    data: dict[str, Any] = {"name": "web", "kind": pb.WorkloadSpec.PROCESS, "command": ["sleep"]}
    data.update(overrides)
    return pb.WorkloadSpec(**data)


VM = pb.WorkloadSpec.VM
CONTAINER = pb.WorkloadSpec.CONTAINER

REFUSED = [
    # (case, overrides, the whole message's start)
    ("NUL in an argument", {"command": ["sh", "-c", "a\0b"]}, "spec.command[2]: contains a NUL"),
    ("escape in an argument", {"command": ["a\x1b[2J"]}, "spec.command[0]: contains a control"),
    ("C1 control in an argument", {"command": ["a\x85"]}, "spec.command[0]: contains a control"),
    ("NUL in an env value", {"env": {"K": "v\0"}}, "spec.env['K']: contains a NUL byte"),
    ("NUL in an env key", {"env": {"K\0": "v"}}, "spec.env['K\\x00'] (key): contains a NUL"),
    ("newline in an env key", {"env": {"K\n": "v"}}, "spec.env['K\\n'] (key): contains a control"),
    ("NUL in the image", {"kind": CONTAINER, "image": "nginx\0"}, "spec.image: contains a NUL"),
    ("newline in the image", {"kind": CONTAINER, "image": "a\nb"}, "spec.image: contains a cont"),
    ("NUL in working_dir", {"working_dir": "/srv\0"}, "spec.working_dir: contains a NUL"),
    ("relative working_dir", {"working_dir": "srv"}, "spec.working_dir: must be an absolute"),
    ("working_dir with ..", {"working_dir": "/srv/../root"}, "spec.working_dir: must be a norm"),
    ("working_dir with .", {"working_dir": "/srv/./x"}, "spec.working_dir: must be a normalised"),
    ("working_dir with //", {"working_dir": "/srv//x"}, "spec.working_dir: must be a normalised"),
    ("working_dir leading //", {"working_dir": "//srv"}, "spec.working_dir: must be a normalised"),
    ("working_dir trailing /", {"working_dir": "/srv/"}, "spec.working_dir: must be a normalised"),
    ("relative VM image", {"kind": VM, "command": [], "image": "d.img"}, "spec.image: must be an"),
    ("VM image with ..", {"kind": VM, "image": "/a/../etc/shadow"}, "spec.image: must be a norm"),
    ("relative archive", {"kind": CONTAINER, "image": "oci-archive:b.tar"}, "spec.image: must be"),
    ("archive ..", {"kind": CONTAINER, "image": "oci-archive:/a/../b"}, "spec.image: must be a n"),
    (
        "relative kernel",
        {"kind": VM, "vm": pb.VmSpec(kernel="vmlinuz")},
        "spec.vm.kernel: must be an absolute path",
    ),
    (
        "initrd with ..",
        {"kind": VM, "vm": pb.VmSpec(kernel="/k", initrd="/b/../i")},
        "spec.vm.initrd: must be a normalised",
    ),
    (
        "NUL in cmdline",
        {"kind": VM, "vm": pb.VmSpec(kernel="/k", cmdline="a\0")},
        "spec.vm.cmdline: contains a NUL",
    ),
    ("NUL in a selector value", {"node_selector": {"z": "a\0"}}, "spec.node_selector['z']: conta"),
    (
        "argument too long",
        {"command": ["x" * (MAX_ARG_LENGTH + 1)]},
        f"spec.command[0]: is {MAX_ARG_LENGTH + 1} characters long, over the limit",
    ),
    ("too many arguments", {"command": ["x"] * (MAX_ARGS + 1)}, "spec.command: List should have"),
    (
        "env value too long",
        {"env": {"K": "v" * (MAX_ENV_VALUE_LENGTH + 1)}},
        "spec.env['K']: is 131073 characters long",
    ),
    (
        "too many env entries",
        {"env": {f"K{i}": "" for i in range(MAX_ENV_ENTRIES + 1)}},
        "spec.env: Dictionary should have at most 1024 items",
    ),
    (
        "too many selector entries",
        {"node_selector": {f"k{i}": "" for i in range(MAX_SELECTOR_ENTRIES + 1)}},
        "spec.node_selector: Dictionary should have at most 64 items",
    ),
]


@pytest.mark.parametrize(
    ("overrides", "start"), [pytest.param(o, s, id=case) for case, o, s in REFUSED]
)
def test_bad_text_paths_and_sizes_are_refused_naming_the_field(
    overrides: dict[str, Any], start: str
) -> None:
    with pytest.raises(Invalid) as info:
        convert.spec_from_pb(spec_pb(**overrides))
    assert info.value.message.startswith(start), info.value.message
    assert len(info.value.message) < 400


ACCEPTED = [
    ("script with newlines and tabs", {"command": ["sh", "-c", "a\n\tb"]}),
    ("env value with a newline", {"env": {"PEM": "-----BEGIN\nabc\n-----END\n"}}),
    ("root working_dir", {"working_dir": "/"}),
    ("absolute archive", {"kind": CONTAINER, "image": "oci-archive:/var/lib/orka/b.tar"}),
    ("registry reference", {"kind": CONTAINER, "image": "docker.io/library/busybox:1.36"}),
    ("unicode argument", {"command": ["echo", "grüße ✓"]}),
    ("pin to a node", {"node_selector": {"orka.io/node": "node-1"}}),
    ("largest argument", {"command": ["x" * MAX_ARG_LENGTH]}),
]


@pytest.mark.parametrize("overrides", [pytest.param(o, id=case) for case, o in ACCEPTED])
def test_good_specs_pass(overrides: dict[str, Any]) -> None:
    msg = spec_pb(**overrides)
    assert convert.spec_to_pb(convert.spec_from_pb(msg)) == convert.spec_to_pb(
        convert.spec_from_pb(msg)
    )


def test_a_huge_name_gets_a_short_message() -> None:
    with pytest.raises(Invalid) as info:
        convert.spec_from_pb(spec_pb(name="a" * 1_000_000))
    message = info.value.message
    assert message.startswith("spec.name: name 'aaaa") and "'... must be 1-63" in message
    assert len(message) < 250


def test_a_spec_over_the_limit_names_its_biggest_field() -> None:
    big = spec_pb(env={"A": "x" * 100_000}, command=["y" * 100_000] * 11)
    assert big.ByteSize() > MAX_SPEC_BYTES
    with pytest.raises(Invalid) as info:
        convert.spec_from_pb(big)
    assert info.value.message.startswith("spec.command: is 1100")
    assert f"over the limit of {MAX_SPEC_BYTES} bytes" in info.value.message


def test_many_errors_are_summed_up() -> None:
    with pytest.raises(Invalid) as info:
        convert.spec_from_pb(spec_pb(command=["\0"] * 100))
    assert info.value.message.endswith("; and 95 more")
    assert info.value.message.count("contains a NUL byte") == 5


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("abc", "'abc'"),
        ("a" * 100, "'" + "a" * 64 + "'..."),
        (b"\0" * 70, repr(b"\0" * 64)[:66] + "..."),
        # Escapes make one character ten: the quoted text stays short all the same.
        ("\U0010ffff" * 10, repr("\U0010ffff" * 10)[:66] + "..."),
        # At the limit nothing is cut; one escape past it (67 characters quoted) is.
        ("a" * 64, "'" + "a" * 64 + "'"),
        ("a" * 63 + "\n", repr("a" * 63 + "\n")[:66] + "..."),
    ],
)
def test_quote_cuts(value: object, expected: str) -> None:
    assert quote(value) == expected
    assert len(quote(value)) <= 69


@pytest.mark.parametrize(
    ("path", "roots", "inside"),
    [
        ("/var/lib/orka/images/a.img", ["/var/lib/orka/images"], True),
        ("/var/lib/orka/images", ["/var/lib/orka/images/"], True),
        ("/var/lib/orka/images-other/a", ["/var/lib/orka/images"], False),
        ("/etc/shadow", ["/var/lib/orka"], False),
        ("/anything", ["/"], True),
        ("/x", [], False),
        # A root is a path, not a set of characters to trim: /data/X does not hold /data/Y.
        ("/data/Y", ["/data/X"], False),
        ("/data/X/y", ["/data/X//"], True),
    ],
)
def test_path_within(path: str, roots: list[str], inside: bool) -> None:
    check_path(path)
    assert path_within(path, roots) is inside


def test_reserved_labels() -> None:
    assert reserved_labels({"zone": "a", "orka.io/node": "x", "orka.io/pool": "p"}) == [
        "orka.io/node",
        "orka.io/pool",
    ]
    assert reserved_labels({"orka.iox": "a", "myorka.io/x": "b"}) == []


def test_big_specs_are_not_kept_in_the_parse_cache() -> None:
    """The cache holds each key and model: 1,024 big specs were ~1.7 GB of controller memory
    (every update of a big workload added ~1.7 MB)."""
    before = convert._spec_from_bytes.cache_info().currsize
    for i in range(3):
        convert.spec_from_pb(spec_pb(env={"V": f"{i}" + "x" * 100_000}))
    assert convert._spec_from_bytes.cache_info().currsize == before
    convert.spec_from_pb(spec_pb(env={"V": "small-and-new"}))
    assert convert._spec_from_bytes.cache_info().currsize == before + 1


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"working_dir": "srv"}, "spec.working_dir: must be an absolute path, got 'srv'"),
        (
            {"working_dir": "/srv/../root"},
            "spec.working_dir: must be a normalised path (no '.' or '..' component, no '//', "
            "no trailing '/'), got '/srv/../root'",
        ),
        ({"env": {"A=B": "v"}}, "spec.env['A=B'] (key): must be non-empty without '='"),
        (
            {"node_selector": {"-zone": "a"}},
            "spec.node_selector['-zone'] (key): '-zone' is not a valid label key (letters, "
            "digits, '.', '_', '/', '-', starting with a letter or digit)",
        ),
    ],
)
def test_the_whole_refusal_of_a_path_an_env_key_and_a_label_key(
    overrides: dict[str, Any], message: str
) -> None:
    with pytest.raises(Invalid) as info:
        convert.spec_from_pb(spec_pb(**overrides))
    assert info.value.message == message
