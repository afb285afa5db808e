"""A Mooncake store's settings in every form SGLang reads them, read as the
SGLang release in use reads them (its ``MooncakeStoreConfig``).

Where the settings come from, first match wins (both releases):

1. ``--hicache-storage-backend-extra-config`` when it names
   ``master_server_address`` or ``client_server_address``;
2. else the JSON file ``SGLANG_HICACHE_MOONCAKE_CONFIG_PATH`` names (it must
   name one of the two);
3. else the environment of Mooncake's SGLang guide: ``MOONCAKE_MASTER`` (or
   ``MOONCAKE_CLIENT``), ``MOONCAKE_TE_META_DATA_SERVER``,
   ``MOONCAKE_GLOBAL_SEGMENT_SIZE``, ``MOONCAKE_PROTOCOL``, ``MOONCAKE_DEVICE``,
   ``MOONCAKE_LOCAL_HOSTNAME`` (legacy ``LOCAL_HOSTNAME``), ``MOONCAKE_TENANT_ID``,
   ``MOONCAKE_STANDALONE_STORAGE``, ``MOONCAKE_ENABLE_SSD_OFFLOAD``,
   ``MOONCAKE_OFFLOAD_FILE_STORAGE_PATH``.

Defaults are SGLang's (P2PHANDSHAKE, rdma, 4gb, localhost, tenant
``default``). Where the releases differ, each is followed: SGLang 0.5.23
takes ``MOONCAKE_LOCAL_HOSTNAME`` / ``LOCAL_HOSTNAME`` over a config's
``local_hostname`` and ``MOONCAKE_PROTOCOL`` where a config names no
protocol; 0.5.18 reads those only in the environment form. Like SGLang,
``global_segment_size`` is what a TP group lends the store: each rank mounts
its share (divided by the TP size; TP x PP on 0.5.23). A JSON
``device_name`` maps TP ranks to RDMA devices. ``local_buffer_size`` (the
client's staging buffer, 16 MiB by default) is this library's own key.

Under CP a master is required (each rank opens its own client): a
client-only store (``client_server_address`` / ``MOONCAKE_CLIENT`` alone) or
``standalone_storage`` is refused, naming it. ``check_server`` and
``master_metrics_port`` (SGLang's optional HTTP pre-check) are not used: a
client that cannot reach its master fails to open, naming it.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from sglang_cp_hicache.l3.location import MOONCAKE_FORMS, mooncake_form, parse_extra_config
from sglang_cp_hicache.l3_backends.mooncake import MIN_SEGMENT_BYTES, MooncakeConfig
from sglang_cp_hicache.sizes import parse_mooncake_size
from sglang_cp_hicache.sizes import MOONCAKE_FLAG_FALSE, MOONCAKE_FLAG_TRUE
from sglang_cp_hicache.settings import (
    LOCAL_HOSTNAME, MOONCAKE_CLIENT, MOONCAKE_CONFIG_PATH, MOONCAKE_DEVICE, MOONCAKE_LOCAL_HOSTNAME,
    MOONCAKE_MASTER, MOONCAKE_METADATA_SERVER, MOONCAKE_PROTOCOL, MOONCAKE_SEGMENT_SIZE, MOONCAKE_SSD_OFFLOAD,
    MOONCAKE_SSD_PATH, MOONCAKE_STANDALONE_STORAGE, MOONCAKE_TENANT_ID, Setting, read,
)

__all__ = ["RELEASES", "SGLangRules", "sglang_mooncake_config"]

logger = logging.getLogger(__name__)

RELEASES = ("0.5.18", "0.5.23")
#: The environment form: SGLang's config key -> its variable.
_ENVIRONMENT: dict[str, Setting] = {
    "master_server_address": MOONCAKE_MASTER, "client_server_address": MOONCAKE_CLIENT,
    "metadata_server": MOONCAKE_METADATA_SERVER, "global_segment_size": MOONCAKE_SEGMENT_SIZE,
    "protocol": MOONCAKE_PROTOCOL, "device_name": MOONCAKE_DEVICE, "tenant_id": MOONCAKE_TENANT_ID,
    "standalone_storage": MOONCAKE_STANDALONE_STORAGE, "enable_ssd_offload": MOONCAKE_SSD_OFFLOAD,
    "ssd_offload_path": MOONCAKE_SSD_PATH,
}
#: SGLang's words for a boolean variable (shared with settings.check_all).
_TRUE, _FALSE = MOONCAKE_FLAG_TRUE, MOONCAKE_FLAG_FALSE


@dataclass(frozen=True)
class SGLangRules:
    """How the SGLang release in use reads Mooncake's settings, for one rank:
    ``release`` (``"0.5.18"`` or ``"0.5.23"``), ``segment_ranks`` (the ranks
    a ``global_segment_size`` is shared by: TP size, times PP size on
    0.5.23) and ``rank`` (its TP rank: picks its device from a JSON map and
    names its SSD offload directory)."""

    release: str = "0.5.23"
    segment_ranks: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        if self.release not in RELEASES:
            raise ValueError(f"release must be one of {', '.join(RELEASES)}, got {self.release!r}")
        for name, minimum in (("segment_ranks", 1), ("rank", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _file_settings(environ: Optional[Mapping[str, str]]) -> dict[str, Any]:
    path = read(MOONCAKE_CONFIG_PATH, environ)
    what = f"{MOONCAKE_CONFIG_PATH.name}={path}"
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{what}: cannot read the Mooncake config file: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what}: the Mooncake config file must hold a JSON object, got {type(data).__name__}")
    if "master_server_address" not in data and "client_server_address" not in data:
        raise ValueError(f"{what}: the Mooncake config file names neither master_server_address nor "
                         "client_server_address")
    return data


def _environment_settings(environ: Optional[Mapping[str, str]]) -> dict[str, Any]:
    return {key: value for key, setting in _ENVIRONMENT.items() if (value := read(setting, environ))}


def _flag(name: str, value: Any) -> bool:
    if value is None or isinstance(value, bool):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"{name} must be a boolean ({'/'.join(_TRUE)} or {'/'.join(_FALSE)}), got {value!r}")


def _local_hostname(raw: Mapping[str, Any], form: str, rules: SGLangRules,
                    environ: Optional[Mapping[str, str]]) -> Any:
    if form == MOONCAKE_FORMS[2] or rules.release == "0.5.23":
        for setting in (MOONCAKE_LOCAL_HOSTNAME, LOCAL_HOSTNAME):  # the process's own address first
            if value := read(setting, environ):
                return value
        if form == MOONCAKE_FORMS[2]:
            return "localhost"
        return raw.get("local_hostname") or "localhost"
    return raw.get("local_hostname", "localhost")


def _device(value: Any, rules: SGLangRules) -> Any:
    """A device, or this rank's from a JSON map of TP rank -> device."""
    if not isinstance(value, str) or not value.strip().startswith("{"):
        return value
    try:
        devices = json.loads(value)
    except ValueError:
        logger.warning("Mooncake device_name is not a JSON map: %r; using none", value)
        return ""
    return devices.get(rules.rank) or devices.get(str(rules.rank)) or ""


def sglang_mooncake_config(
    extra: Any, rules: Optional[SGLangRules] = None, environ: Optional[Mapping[str, str]] = None,
) -> MooncakeConfig:
    """One rank's Mooncake client settings from ``extra`` (the extra config:
    a JSON object, ``@file`` or a dict), the file or the environment, as
    ``rules`` (default: SGLang 0.5.23, one rank) says SGLang reads them
    (see the module doc). Raises ValueError / TypeError naming the setting."""
    rules = rules if rules is not None else SGLangRules()
    extra = parse_extra_config(extra)
    form = mooncake_form(extra, environ)
    raw = (dict(extra) if form == MOONCAKE_FORMS[0] else _file_settings(environ) if form == MOONCAKE_FORMS[1]
           else _environment_settings(environ))
    where = {MOONCAKE_FORMS[1]: f" (from {MOONCAKE_CONFIG_PATH.name})",
             MOONCAKE_FORMS[2]: " (from the environment)"}.get(form, "")
    master = raw.get("master_server_address")
    if master is None or (isinstance(master, str) and not master.strip()):
        raise ValueError(f"master_server_address{where} is required under CP (each rank opens its own Mooncake "
                         f"client); a client-only store (client_server_address / {MOONCAKE_CLIENT.name}) is not "
                         "supported")
    if _flag("standalone_storage", raw.get("standalone_storage")):
        raise ValueError(f"standalone_storage{where} is not supported under CP: each rank opens its own client")
    protocol_default = read(MOONCAKE_PROTOCOL, environ) if rules.release == "0.5.23" else ""
    total = parse_mooncake_size(f"global_segment_size{where}", raw.get("global_segment_size", "4gb"))
    per_rank = total // rules.segment_ranks
    if per_rank < MIN_SEGMENT_BYTES:
        raise ValueError(f"global_segment_size{where} of {total} bytes is shared by {rules.segment_ranks} rank(s): "
                         f"{per_rank} bytes each, below Mooncake's {MIN_SEGMENT_BYTES}")
    tenant = raw.get("tenant_id")
    ssd_path = raw.get("ssd_offload_path")
    if ssd_path is not None:  # one directory per rank: clients sharing one overwrite each other's files
        ssd_path = os.path.join(str(ssd_path), f"rank_{rules.rank}")
    buffer = raw.get("local_buffer_size")
    return MooncakeConfig(
        master_server_address=master,
        metadata_server=raw.get("metadata_server", "P2PHANDSHAKE"),
        local_hostname=_local_hostname(raw, form, rules, environ),
        protocol=raw.get("protocol", protocol_default or "rdma"),
        device_name=_device(raw.get("device_name", ""), rules),
        global_segment_size=per_rank,
        local_buffer_size=(MooncakeConfig.local_buffer_size if buffer is None
                           else parse_mooncake_size("local_buffer_size", buffer)),
        tenant_id=(str(tenant).strip() or "default") if tenant is not None else "default",
        enable_ssd_offload=_flag("enable_ssd_offload", raw.get("enable_ssd_offload")),
        ssd_offload_path=ssd_path,
    )
