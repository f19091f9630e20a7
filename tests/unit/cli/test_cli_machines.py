"""``ftq machines``: one line per machine, a lost one marked LOST, each GPU with its job."""

from __future__ import annotations

from cli.machines import format_machines


def machine(name: str, status: str, **fields):
    return {"name": name, "address": None, "status": status, "heartbeat_age_s": 2.0, "remote": False,
            "workers": [name], "gpus": [], "jobs": [], **fields}


class TestFormatMachines:
    def test_a_lost_remote_machine_is_marked_with_its_gpus_and_jobs(self):
        text = format_machines([
            machine("box-a", "live", address="10.0.0.1", gpus=[{"worker": "box-a", "slot": 0, "device": "0", "job": None}]),
            machine("box-b", "lost", address="10.0.0.2", remote=True, heartbeat_age_s=612.4,
                    gpus=[{"worker": "box-b", "slot": 0, "device": "0", "job": "job-1"},
                          {"worker": "box-b", "slot": 1, "device": None, "job": None}]),
        ])

        assert text.splitlines() == [
            "MACHINE  ADDRESS   STATUS  WORKERS   HEARTBEAT  GPUS",
            "box-a    10.0.0.1  live    1 local   2s ago     0:free",
            "box-b    10.0.0.2  LOST    1 remote  612s ago   0:job-1 slot1:free",
        ]

    def test_no_machine_says_how_to_start_a_worker(self):
        assert "ftq worker --gpus all" in format_machines([])
