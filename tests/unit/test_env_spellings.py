"""Every package variable's accepted and refused spellings, table-driven from envs.VARIABLES.

test_env_vars.py checks that a bad value fails the engine config and that vLLM knows the
names; this file checks each variable's parser on its own: every accepted spelling reads
as the right value (of the right type), every bad one raises one FlashInferEPEnvVarError
naming the variable, the spelling and the accepted values, and an unknown name under the
package's prefix is refused. A variable added to envs.VARIABLES without cases here fails
`test_every_variable_has_cases`.
"""

from __future__ import annotations

import pytest

from vllm_flashinfer_ep import envs
from vllm_flashinfer_ep.errors import FlashInferEPEnvVarError

BOOL_TRUE = [
    "1",
    "true",
    "TRUE",
    "True",
    "tRuE",
    "yes",
    "YES",
    "Yes",
    "on",
    "ON",
    "On",
    " 1 ",
    "\ttrue\n",
]
BOOL_FALSE = [
    "0",
    "false",
    "FALSE",
    "False",
    "no",
    "NO",
    "No",
    "off",
    "OFF",
    "oFf",
    " 0 ",
    "\toff\n",
]
BOOL_BAD = [
    "2",
    "-1",
    "maybe",
    "y",
    "n",
    "t",
    "f",
    "1.0",
    "0.0",
    "+1",
    "01",
    "enable",
    "disabled",
    "truee",
    "yes!",
    "1 0",
    "on off",
    "true,false",
    "null",
    "none",
]


def _bool_cases(default: bool) -> dict:
    return {
        "default": default,
        "accepted": [(raw, True) for raw in BOOL_TRUE]
        + [(raw, False) for raw in BOOL_FALSE]
        + [("", default), ("   ", default)],
        "bad": BOOL_BAD,
    }


def _rdma_cases() -> dict:
    """The RDMA buffer's range is envs' (it is being bounded): read it, never restate it."""
    low = getattr(envs, "RDMA_MIN_BYTES", None)
    if low is None:
        low = envs.rdma_min_bytes() if hasattr(envs, "rdma_min_bytes") else 1
    high = getattr(envs, "RDMA_MAX_BYTES", None)
    accepted = [
        ("0", 0),
        (" 0 ", 0),
        ("", 0),
        (str(low), low),
        (f" {low} ", low),
        (str(low + 1), low + 1),
    ]
    bad = [
        "-1",
        "-0x10",
        "abc",
        "1.5e9",
        "1e9",
        "1GiB",
        "1 GiB",
        "0x100000",
        "1,000,000",
        "4096.0",
        "one",
    ]
    if low > 1:
        bad.append(str(low - 1))  # 0 means "sized by NCCL-EP"; 1 .. low-1 is too small
    if high is not None:
        accepted.append((str(high), high))
        bad += [str(high + 1), str(10 * high)]
    else:
        accepted.append((str(1 << 40), 1 << 40))
    return {"default": 0, "accepted": accepted, "bad": bad}


CASES: dict[str, dict] = {
    envs.HANDLE_POOL: _bool_cases(True),
    envs.SKIP_ENV_CHECKS: _bool_cases(False),
    envs.FP8_DISPATCH: _bool_cases(True),
    envs.NATIVE_EAGER: _bool_cases(True),
    envs.FT_TIMEOUT_MS: {
        "default": envs.DEFAULT_FT_TIMEOUT_MS,
        "accepted": [
            ("1", 1),
            ("20000", 20_000),
            (" 1234 ", 1234),
            ("\t5\n", 5),
            ("+7", 7),
            ("600000", 600_000),
            (str(envs.FT_TIMEOUT_MAX_MS), envs.FT_TIMEOUT_MAX_MS),
            ("", envs.DEFAULT_FT_TIMEOUT_MS),
            ("  ", envs.DEFAULT_FT_TIMEOUT_MS),
        ],
        "bad": [
            "0",
            "-1",
            "-20000",
            "soon",
            "1.5",
            "1e3",
            "20s",
            "20 000",
            "0x10",
            "inf",
            "nan",
            "20_000",  # int() takes it; the accepted text does not promise it
            "\u0661\u0662\u0663",  # Arabic-Indic digits, which int() reads as 123
            "++5",
            str(envs.FT_TIMEOUT_MAX_MS + 1),
            "18446744073710",  # overflowed NCCL-EP's unsigned 64-bit nanoseconds
        ],
    },
    envs.TRANSPORT: {
        "default": envs.DEFAULT_TRANSPORT,
        "accepted": [
            ("nccl_ep", "nccl_ep"),
            ("nixl_ep", "nixl_ep"),
            (" nixl_ep ", "nixl_ep"),
            ("\tnccl_ep\n", "nccl_ep"),
            ("", envs.DEFAULT_TRANSPORT),
        ],
        # Transport names are exact (its accepted text, unlike the booleans', says no case).
        "bad": [
            "foo",
            "nccl",
            "nixl",
            "NCCL_EP",
            "Nixl_EP",
            "nccl-ep",
            "deepep",
            "nccl_ep,nixl_ep",
            "nccl_ep nixl_ep",
        ],
    },
    envs.RDMA_BUFFER_BYTES: _rdma_cases(),
    envs.DEEP_GEMM_RECEIVED_ROWS: {
        "default": 4.0,
        "accepted": [
            ("0", 0.0),
            ("4", 4.0),
            ("2.5", 2.5),
            (".5", 0.5),
            ("3.", 3.0),
            ("+1", 1.0),
            (" 8 ", 8.0),
            ("inf", float("inf")),
            ("INF", float("inf")),
            ("Infinity", float("inf")),
            ("", 4.0),
        ],
        "bad": ["-1", "-0.5", "nan", "NaN", "-inf", "1e3", "1_0", "many", "4 rows", "0x4", "."],
    },
    envs.EXCHANGE_TIMEOUT_S: {
        "default": envs.DEFAULT_EXCHANGE_TIMEOUT_S,
        "accepted": [
            ("1", 1),
            ("30", 30),
            (" 45 ", 45),
            ("+5", 5),
            (str(envs.EXCHANGE_TIMEOUT_MAX_S), envs.EXCHANGE_TIMEOUT_MAX_S),
            ("", envs.DEFAULT_EXCHANGE_TIMEOUT_S),
        ],
        "bad": [
            "0",
            "-1",
            "0.5",
            "2.5",
            "30s",
            "1e2",
            "inf",
            "never",
            "30_000",
            str(envs.EXCHANGE_TIMEOUT_MAX_S + 1),
        ],
    },
    envs.LL_ROUND_TOKENS: {
        "default": 0,
        "accepted": [
            ("0", 0),
            ("512", 512),
            (" 1024 ", 1024),
            ("+256", 256),
            (str(envs.LL_ROUND_TOKENS_MAX), envs.LL_ROUND_TOKENS_MAX),
            ("", 0),
        ],
        "bad": ["-1", "0.5", "512 tokens", "1e3", "5_12", "inf", str(envs.LL_ROUND_TOKENS_MAX + 1)],
    },
}

ACCEPTED = [(name, raw, value) for name, c in CASES.items() for raw, value in c["accepted"]]
BAD = [(name, raw) for name, c in CASES.items() for raw in c["bad"]]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in envs.VARIABLES:
        monkeypatch.delenv(var.name, raising=False)


def test_every_variable_has_cases():
    """A new variable needs its spellings here; a removed one must leave."""
    assert set(CASES) == set(envs.BY_NAME)
    for name, c in CASES.items():
        assert c["accepted"] and c["bad"], name
    assert [v.name for v in envs.VARIABLES] == list(envs.BY_NAME)  # no name twice


@pytest.mark.parametrize("name", sorted(CASES))
def test_default_when_unset_and_the_documented_default_parses(name):
    var, want = envs.BY_NAME[name], CASES[name]["default"]
    got = var.value({})
    assert got == want and type(got) is type(want)
    assert var.parse(name, var.default) == want
    assert var.accepted and var.meaning


@pytest.mark.parametrize(("name", "raw", "value"), ACCEPTED)
def test_accepted_spelling_reads_as_its_value(monkeypatch, name, raw, value):
    var = envs.BY_NAME[name]
    got = var.value({name: raw})
    assert got == value and type(got) is type(value), (raw, got)
    envs.validate_all({name: raw})
    monkeypatch.setenv(name, raw)  # the process environment reads the same
    assert var.value() == value
    envs.validate_all()


@pytest.mark.parametrize(("name", "raw"), BAD)
def test_bad_spelling_raises_one_error_naming_variable_and_accepted_values(monkeypatch, name, raw):
    var = envs.BY_NAME[name]
    with pytest.raises(FlashInferEPEnvVarError) as info:
        var.value({name: raw})
    message = str(info.value)
    assert name in message and repr(raw.strip()) in message and var.accepted in message
    with pytest.raises(FlashInferEPEnvVarError) as info:
        envs.validate_all({name: raw})
    assert str(info.value) == message  # the same one error at config time
    monkeypatch.setenv(name, raw)
    with pytest.raises(FlashInferEPEnvVarError, match=name):
        var.value()


def test_every_bad_variable_is_named_in_one_error():
    environ = {name: c["bad"][0] for name, c in CASES.items()}
    with pytest.raises(FlashInferEPEnvVarError) as info:
        envs.validate_all(environ)
    message = str(info.value)
    for name, raw in environ.items():
        assert f"{name}={raw!r}" in message
        assert envs.BY_NAME[name].accepted in message


@pytest.mark.parametrize(
    "unknown",
    # Built from envs' names: test_env_vars.py refuses unknown names spelt out in the repo.
    [
        envs.HANDLE_POOL + "S",  # a typo of a real name
        envs.TRANSPORT + "_",
        envs.PREFIX + "transport",  # names are case-sensitive
        envs.PREFIX,
        envs.PREFIX + "RDMA_BYTES",
    ],
)
def test_unknown_name_under_the_prefix_is_refused_naming_it_and_the_known_ones(unknown):
    # Valid values for every known variable: the unknown name alone is the error.
    environ = {name: c["accepted"][0][0] for name, c in CASES.items()}
    environ[unknown] = "1"
    with pytest.raises(FlashInferEPEnvVarError) as info:
        envs.validate_all(environ)
    message = str(info.value)
    assert unknown in message and "not a vllm-flashinfer-ep variable" in message
    assert all(name in message for name in envs.BY_NAME)
    with pytest.raises(ValueError, match=unknown):
        envs.validate_env(environ)


@pytest.mark.parametrize(
    "other", ["VLLM_FLASHINFER_EPX", "FLASHINFER_EP_TEST_TRANSPORT", "VLLM_FLASHINFER_E"]
)
def test_names_outside_the_prefix_are_not_ours(other):
    envs.validate_all({other: "anything"})
