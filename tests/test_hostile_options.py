"""Property-based hostile tests of option values given as text (issue 33): every option of the
table that reads text (numbers, devices, scene cuts, choices, frame rates), through
``resolve_options`` as Python callers and workflows give them and through ``seedvr2 upscale``
flags. The invariant (tests/hostile.py): the value is read as its plain spelling says, or one
:class:`OptionError` names the option; never another exception, and never a value read from a
spelling that is not plain ASCII decimal (``1_0``, ``²``, ``١``, ``+3``)."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, strategies as st

from hostile import outcome, run_cli
from seedvr2.options import OPTIONS, OptionError, resolve_options

# Characters that make numbers and lists, and their look-alikes.
ALPHABET = "0123456789,,,  -+._:/eE" + "²١٣\t\n" + "autoffcpu"
TEXT = st.text(ALPHABET, max_size=12)
TOKENS = st.lists(st.sampled_from(["cuda:", "cpu", "auto", "off", ",", " ", "1_0", "²", "+3",
                                   "0x1", "1e3", "30000/1001", "/", "-1", "12", "inf", "nan"]),
                  max_size=5).map("".join)
# Ways to spell a number that Python's int()/float() read but a person rarely means.
SUPERSCRIPT, ARABIC_INDIC = str.maketrans("0123456789", "⁰¹²³⁴⁵⁶⁷⁸⁹"), \
    str.maketrans("0123456789", "٠١٢٣٤٥٦٧٨٩")
SPELLINGS = [str, lambda n: f"{n}_0", lambda n: f"+{n}", lambda n: f"{n}\n",
             lambda n: str(n).translate(ARABIC_INDIC), lambda n: str(n).translate(SUPERSCRIPT),
             lambda n: f"{n},{n}", lambda n: f"{n}, {n + 4}", lambda n: "", lambda n: f" {n} "]
OTHER_TEXT = st.one_of(TEXT, TOKENS, st.lists(st.integers(0, 40), max_size=5).map(
    lambda v: ",".join(map(str, v))))
# A spelling of a number, or other text (None): drawn first, so every spelling comes up.
NUMBER_TEXT = st.tuples(st.sampled_from([*SPELLINGS, None, None, None]), st.integers(0, 64),
                        OTHER_TEXT).map(lambda d: d[2] if d[0] is None else d[0](d[1]))
PLAIN_INT = re.compile(r"[ ]*-?[0-9]+[ ]*")
PLAIN_CUTS = re.compile(r"[ ]*[0-9]+[ ]*(,[ ]*[0-9]+[ ]*)*")
TEXT_OPTIONS = sorted(name for name, opt in OPTIONS.items() if opt.type is not bool)


def _resolved(name, text):
    return resolve_options(**{name: text}).values[name]


@pytest.mark.parametrize("name", TEXT_OPTIONS)
@given(text=NUMBER_TEXT)
def test_option_text_is_read_as_written_or_refused_naming_the_option(name, text):
    _check_read(name, text, outcome(lambda: _resolved(name, text), name))


def _check_read(name, text, result):
    opt = OPTIONS[name]
    if result.refused:
        assert len(result.message) < 400, result.message  # no echo of a huge value
        return
    value = result.value
    auto = opt.accepts_auto and text.strip().lower() == "auto"
    if opt.type is int and not auto:
        assert PLAIN_INT.fullmatch(text), f"{name} read {text!r} as {value!r}"
        assert value == int(text)
    if opt.type is float:
        assert text.isascii() and "_" not in text, f"{name} read {text!r} as {value!r}"
    if name == "scene_cuts" and text.strip().lower() not in ("auto", "off"):
        assert PLAIN_CUTS.fullmatch(text), f"scene_cuts read {text!r} as {value!r}"
        assert value == tuple(sorted(int(v) for v in text.split(",")))
    if name in ("device", "devices", "dit_device", "vae_device") and value != "auto":
        assert value.isascii(), f"{name} read {text!r} as {value!r}"
    if opt.choices:
        assert value in opt.choices


@pytest.mark.parametrize("name", TEXT_OPTIONS)
@given(text=NUMBER_TEXT)
def test_option_flags_are_read_as_written_or_refused_in_one_line(tmp_path_factory, name, text):
    """``seedvr2 upscale --dry-plan`` with one hostile flag: status 0 with the value read as
    written, or a clean refusal (status 2, argparse's or ours) naming the flag."""
    folder = tmp_path_factory.mktemp("flags")
    run = run_cli(["upscale", str(folder / "missing.png"), "--dry-plan",
                   f"{OPTIONS[name].flag}={text}"])
    if run.status == 2:
        assert OPTIONS[name].flag in run.stderr, run.stderr
    else:  # read; then the missing input is what is refused (or, for --dry-plan, auto)
        flag = OPTIONS[name].flag
        assert run.status == 1 and ("missing.png" in run.stderr or flag in run.stderr), \
            run.stderr
        _check_read(name, text, outcome(lambda: _resolved(name, text), name))


# The kinds the issue found, each as one example.

@pytest.mark.parametrize("text", ["1_0", "²", "١٢", "+3", "3_", "", " ", ",", "5,,7", "0x10"])
def test_scene_cuts_are_plain_decimal_digits_and_never_empty(text):
    with pytest.raises(OptionError) as refused:
        resolve_options(scene_cuts=text)
    assert str(refused.value) == (
        f"scene_cuts = {text!r}: expected auto, off, or frame numbers such as 120,348 (digits "
        f"0-9 separated by commas)")


@pytest.mark.parametrize("name, text", [("resolution", "1_024"), ("batch_size", "١"),
                                        ("seed", "+0"), ("input_noise_scale", "0_5"),
                                        ("chunk_size", "²")])
def test_number_options_are_plain_decimal(name, text):
    with pytest.raises(OptionError, match=f"^{name} = {re.escape(repr(text))}: expected a "):
        resolve_options(**{name: text})
    run = run_cli(["upscale", "in.png", f"{OPTIONS[name].flag}={text}"])
    assert run.status == 2 and f"argument {OPTIONS[name].flag}: invalid " in run.stderr


def test_devices_are_plain_decimal():
    for name in ("device", "devices"):
        with pytest.raises(OptionError, match=f"^{name} = 'cuda:²': expected "):
            resolve_options(**{name: "cuda:²"})


def test_a_duplicate_among_120000_cuts_is_found_fast_and_quoted_short():
    import time

    frames = list(range(1, 120_001))
    frames[-1] = 119_998  # last, where a search that counts each value takes longest
    text = ",".join(map(str, frames))
    start = time.perf_counter()
    with pytest.raises(OptionError) as refused:
        resolve_options(scene_cuts=text)
    took = time.perf_counter() - start
    message = str(refused.value)
    assert message == (f"scene_cuts = {repr(text)[:60]}... ({len(text) + 2} characters): "
                       f"frame 119998 is given twice; give each cut once")
    assert took < 5  # quadratic took ~100 s; linear takes ~0.1 s (a bound, not a benchmark)
    with pytest.raises(OptionError) as refused:  # a list, as Python callers give it
        resolve_options(scene_cuts=frames)
    assert str(refused.value).endswith("frame 119998 is given twice; give each cut once")
    assert len(str(refused.value)) < 200
