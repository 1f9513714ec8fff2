"""io_spec.json and host_settings.json: each family's settings and an io spec go to the JSON typed out by hand in
tests/support/contract_cases and come back equal; an unknown, missing or ill-typed format, and a malformed file,
are refused with a ContractError (exit code 2) that says what is wrong and what to do."""

from __future__ import annotations

import json

import pytest

from zoo.contract.host_settings import FastWAMHostSettings, LingBotVAHostSettings, NoHostSettings
from zoo.contract.io_spec import IoSpec
from zoo.contract.run_folder import RunFolder
from zoo.core.errors import EXIT_ERROR, ContractError, ZooError

from support.contract_cases import (FAST_WAM_JSON, IO_SPEC_JSON, LINGBOT_VA_JSON, LLAMA_JSON, fast_wam_settings,
                                    io_spec_case, lingbot_va_settings, llama_settings)

CASES = {"llama": (llama_settings, LLAMA_JSON), "lingbot_va": (lingbot_va_settings, LINGBOT_VA_JSON),
         "fast_wam": (fast_wam_settings, FAST_WAM_JSON), "none": (NoHostSettings, {"format": 1, "family": "none"})}


@pytest.fixture
def run(tmp_path):
    folder = RunFolder(tmp_path / "run")
    folder.path.mkdir()
    return folder


@pytest.mark.parametrize("family", sorted(CASES))
def test_host_settings_round_trip_through_the_hand_written_json(run, family):
    build, written = CASES[family]
    run.write_host_settings(build())
    assert json.loads(run.host_settings_file.read_text()) == written
    assert run.read_host_settings() == build()


def test_io_spec_round_trips_through_the_hand_written_json(run):
    run.write_io_spec(io_spec_case())
    assert json.loads(run.io_spec_file.read_text()) == IO_SPEC_JSON
    back = run.read_io_spec()
    assert back == io_spec_case()
    assert back.methods["video_step"].inputs[0].shape == [2, 48, "frames", 8]  # a named dim stays a name


def test_the_runner_picks_the_host_loop_by_the_lerobot_policy_type():
    # LeRobot's config "type" of each family's checkpoints, as written in their config.json.
    assert (LingBotVAHostSettings.policy_type, FastWAMHostSettings.policy_type) == ("lingbot_va", "fastwam")
    assert NoHostSettings.policy_type is None


def _refused(path, data, reader):
    path.write_text(json.dumps(data))
    with pytest.raises(ContractError) as caught:
        reader()
    assert caught.value.exit_code == EXIT_ERROR and "re-export the run with this zoo" in caught.value.hint
    return caught.value.message


@pytest.mark.parametrize("which", ["io_spec", "host_settings"])
def test_an_unknown_format_is_refused(run, which):
    data = dict(IO_SPEC_JSON if which == "io_spec" else LLAMA_JSON, format=7)
    path, reader = getattr(run, f"{which}_file"), getattr(run, f"read_{which}")
    assert _refused(path, data, reader) == f"{path} has format 7; this zoo reads format 1"


@pytest.mark.parametrize("which", ["io_spec", "host_settings"])
def test_a_file_without_a_format_is_refused(run, which):
    data = {k: v for k, v in (IO_SPEC_JSON if which == "io_spec" else LLAMA_JSON).items() if k != "format"}
    path, reader = getattr(run, f"{which}_file"), getattr(run, f"read_{which}")
    message = _refused(path, data, reader)
    assert message.startswith(f'{path} has no "format" field') and "this zoo reads format 1" in message


def test_a_format_that_is_no_whole_number_is_refused(run):
    message = _refused(run.io_spec_file, dict(IO_SPEC_JSON, format="1"), run.read_io_spec)
    assert message == f"{run.io_spec_file} has \"format\": '1', not a whole number; this zoo reads format 1"


def test_the_old_io_spec_shape_with_methods_at_the_top_is_refused(run):
    # What earlier zoo releases also accepted: the per-method entries at the top level, no "methods" key.
    old = {"format": 1, "video_step": IO_SPEC_JSON["methods"]["video_step"]}
    message = _refused(run.io_spec_file, old, run.read_io_spec)
    assert message == f"{run.io_spec_file} has unexpected key(s) video_step"


def test_a_missing_key_is_named(run):
    settings = {k: v for k, v in LINGBOT_VA_JSON.items() if k != "kv_pool"}
    assert _refused(run.host_settings_file, settings, run.read_host_settings) == \
        f"{run.host_settings_file} is missing key(s) kv_pool"


def test_a_value_of_the_wrong_type_is_named_by_its_key_path(run):
    settings = json.loads(json.dumps(LINGBOT_VA_JSON))
    settings["kv_pool"]["tokens"] = "96"
    assert _refused(run.host_settings_file, settings, run.read_host_settings) == \
        f"{run.host_settings_file}, key kv_pool.tokens should be a whole number, not '96'"
    spec = json.loads(json.dumps(IO_SPEC_JSON))
    spec["methods"]["video_step"]["inputs"][1]["shape"] = [True]
    assert _refused(run.io_spec_file, spec, run.read_io_spec) == \
        f"{run.io_spec_file}, key methods.video_step.inputs[1].shape[0] should be a string or a whole number, not True"


def test_an_unknown_family_is_refused(run):
    message = _refused(run.host_settings_file, {"format": 1, "family": "zoo_toy"}, run.read_host_settings)
    assert message == (f"{run.host_settings_file} is for family 'zoo_toy', which this zoo does not know "
                       "(it knows fast_wam, lingbot_va, llama, none)")


def test_a_file_that_is_no_json_object_is_refused(run):
    assert _refused(run.io_spec_file, [1, 2], run.read_io_spec) == f"{run.io_spec_file} holds a JSON list, not an object"
    run.io_spec_file.write_text('{"format": 1, "dtype": ')
    with pytest.raises(ZooError) as caught:
        run.read_io_spec()
    assert "is not valid JSON" in str(caught.value) and caught.value.exit_code == EXIT_ERROR


def test_from_json_is_the_same_reader_without_a_folder():
    assert IoSpec.from_json(IO_SPEC_JSON, "io_spec.json") == io_spec_case()
