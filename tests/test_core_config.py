"""The capture options table (core/config.py)."""
from __future__ import annotations

import pytest

from sglang_capture.core.config import CaptureConfig, ConfigError, check_writer_cpus, parse_cpu_list, parse_layers


@pytest.mark.parametrize("text,msg", [("3,x", "comma-separated integers"), (",", "empty")])
def test_layer_option_parsing(text, msg):
    with pytest.raises(ConfigError, match=msg):
        parse_layers(text)


def test_config_round_trips_through_the_environment(tmp_path):
    cfg = CaptureConfig(capture_dir=str(tmp_path), layers=[31, 3, 59], level=3)
    assert cfg.layers == [3, 31, 59]
    assert CaptureConfig.from_env({"SGLANG_CAPTURE_CONFIG": cfg.to_env()}) == cfg
    assert CaptureConfig.from_env({}) is None
    with pytest.raises(ConfigError, match="duplicates"):
        CaptureConfig(capture_dir=str(tmp_path), layers=[3, 3])
    with pytest.raises(ConfigError, match="capture-writers"):
        CaptureConfig(capture_dir=str(tmp_path), writers=-1)
    assert CaptureConfig(capture_dir=str(tmp_path), writers=5).writer_processes() == 5
    with pytest.raises(ConfigError, match="capture-writer-nice must be 0 .* to 19"):
        CaptureConfig(capture_dir=str(tmp_path), writer_nice=20)
    assert parse_cpu_list("2,4-6,4") == [2, 4, 5, 6, 4]
    assert CaptureConfig(capture_dir=str(tmp_path), writer_cpus=[6, 2, 4, 5, 4]).writer_cpus == [2, 4, 5, 6]
    assert CaptureConfig(capture_dir=str(tmp_path), writer_cpus=[0, 1, 2, 3, 4]).writer_processes() == 3
    for bad in ("", "3-1", "-2", "a"):
        with pytest.raises(ConfigError, match="capture-writer-cpus must be a CPU list"):
            parse_cpu_list(bad)
    check_writer_cpus([1, 2], allowed={0, 1, 2})
    with pytest.raises(ConfigError, match=r"names CPUs 3-4,7 that this server may not use; it may use 0-2$"):
        check_writer_cpus([2, 3, 4, 7], allowed={0, 1, 2})
    assert 2 <= CaptureConfig(capture_dir=str(tmp_path)).writer_processes() <= 16


def test_the_launcher_options_are_generated_from_the_one_table():
    """One declaration per option: the launcher's click options are the table's fields, with
    their flags, help and defaults, and parsing them gives the config the table defines."""
    from dataclasses import MISSING, fields

    import click

    from sglang_capture.core.config import config_from_options
    from sglang_capture.server.launch import main

    options = {p.name: p for p in main.params if isinstance(p, click.Option)}
    table = {f.name: f for f in fields(CaptureConfig)}
    assert set(options) == set(table)
    for name, f in table.items():
        meta, opt = f.metadata["option"], options[name]
        assert opt.help == meta["help"] and set(opt.opts) | set(opt.secondary_opts) == set(meta["flag"].split("/"))
        assert opt.required == (f.default is MISSING)
        if meta["parse"] is None and f.default is not MISSING:
            assert opt.default == f.default
    ctx = main.make_context("launch", ["--capture-dir", "/tmp", "--capture-layers", "3,1", "--capture-writer-cpus", "0-1",
                                       "--capture-no-shuffle", "--model-path", "m"])
    config = config_from_options({k: v for k, v in ctx.params.items() if k != "sglang_args"})
    assert (config.layers, config.writer_cpus, config.shuffle, config.codec) == ([1, 3], [0, 1], False, "zstd")
    assert ctx.params["sglang_args"] == ("--model-path", "m")

