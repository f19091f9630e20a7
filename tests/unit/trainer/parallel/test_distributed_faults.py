"""What ends a several-rank run: a rank killed outright, or a stop (SIGTERM to torchrun, what the
worker's cancel sends). Real ``torchrun --nproc_per_node=2`` launches on the CPU (gloo); each test
ends only the processes it started (``distributed_helpers.Started.close``).
"""

from __future__ import annotations

import signal

import pytest
from distributed_helpers import Started, run_here, weights, write_job

from trainer.training import layout

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

LOSS_RTOL = 1e-5
"""As in ``test_distributed_runs`` (float32, only the summation order differs)."""
STOP_STEPS = 10
"""Steps of the stopped job: the stop (sent after step 1's event) lands well before the end even
when torchrun forwards the signal late on a busy machine."""


class TestKilledRank:
    def test_torchrun_fails_naming_the_rank_and_no_process_of_the_job_survives(self, tmp_path, tiny_model_dir):
        job = write_job(tmp_path, tiny_model_dir, "lora", steps=500, checkpoint_every=0)
        started = Started(job, 2, tmp_path / "stderr.txt")
        try:
            started.wait_for("step")
            ranks = started.ranks()
            assert sorted(ranks) == [0, 1], ranks
            ranks[1].kill()  # SIGKILL, as the OOM killer does
            finished = started.finish()
            assert finished.returncode != 0
            assert not started.survivors(), "a process of the job outlived it"
        finally:
            started.close()
        assert "local_rank: 1" in finished.stderr and "SIGKILL" in finished.stderr, finished.stderr[-3000:]
        assert len(finished.of("step")) < 500


class TestStop:
    def test_sigterm_checkpoints_every_rank_and_one_process_resumes_on_the_same_curve(self, tmp_path, tiny_model_dir):
        """Full fine-tuning (FSDP2): SIGTERM to torchrun mid-run; both ranks stop after the same
        step, write its checkpoint (DCP, each rank its shard) and end ``cancelled``; one process
        resumes from it and follows an uninterrupted one-process run to the end."""
        job = write_job(tmp_path / "two", tiny_model_dir, "full", steps=STOP_STEPS, checkpoint_every=0)
        started = Started(job, 2, tmp_path / "stderr.txt")
        try:
            started.wait_for("step")
            started.process.send_signal(signal.SIGTERM)
            stopped = started.finish()
            assert not started.survivors()
        finally:
            started.close()
        assert stopped.done["status"] == "cancelled", (stopped.done, stopped.stderr[-3000:])
        (saved,) = stopped.of("checkpoint")
        at = saved["step"]
        assert 1 < at < STOP_STEPS and not saved["final"], at
        assert (layout.sharded_state_dir(saved["path"]) / "__1_0.distcp").is_file()

        resumed = run_here(job)
        reference = run_here(write_job(tmp_path / "one", tiny_model_dir, "full", steps=STOP_STEPS, checkpoint_every=0))
        for run in (resumed, reference):
            assert run.done["status"] == "succeeded", (run.done, run.stderr[-3000:])
        assert resumed.of("plan")[0]["resumed_from_step"] == at
        got, want = resumed.steps(), reference.steps()
        assert sorted(got) == list(range(at + 1, STOP_STEPS + 1))
        for step in got:
            assert got[step]["loss"] == pytest.approx(want[step]["loss"], rel=LOSS_RTOL), step
        final, expected = weights(layout.export_dir(resumed.out, "full")), weights(layout.export_dir(reference.out, "full"))
        for name in final:
            assert (final[name] - expected[name]).abs().max().item() <= 1e-6, name
