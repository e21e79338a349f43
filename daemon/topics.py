"""The MQTT topic tree of one device (DESIGN.md contract): edgetune/v1/{device_id}/..."""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "edgetune/v1"
INVALID = "invalid"  # cmd/res/invalid: rejections of requests that carry no usable id


@dataclass(frozen=True)
class Topics:
    device_id: str

    @property
    def base(self) -> str:
        return f"{PREFIX}/{self.device_id}"

    @property
    def status(self) -> str:
        return f"{self.base}/status"

    @property
    def info(self) -> str:
        return f"{self.base}/info"

    @property
    def config_active(self) -> str:
        return f"{self.base}/config/active"

    @property
    def record(self) -> str:
        return f"{self.base}/tuning/record"

    @property
    def telemetry(self) -> str:
        return f"{self.base}/telemetry"

    @property
    def cmd_req(self) -> str:
        return f"{self.base}/cmd/req"

    def cmd_res(self, command_id: str | None) -> str:
        return f"{self.base}/cmd/res/{command_id or INVALID}"
