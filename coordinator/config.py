"""``federation.toml``: the coordinator's settings plus the run it coordinates.

::

    [federation]
    credentials = "../.flayer/broker/credentials/coordinator.toml"  # relative paths: to this file
    state_dir = "runs/federation"   # checkpoint, journal/, metrics.jsonl, global.safetensors
    quorum = 2                      # accepted updates that close a round (after grace_s)
    over_selection = 1.3            # select ceil(1.3 x quorum) of the online devices
    min_devices = 2                 # devices online before a round starts
    deadline_s = 600.0              # a round closes at its deadline, whatever arrived
    grace_s = 5.0                   # after the quorum, stragglers get this long
    min_updates = 1                 # fewer at the deadline: extend once by extend_s, else close anyway
    extend_s = 0.0
    announce_wait_s = 10.0          # after quorum + grace, uploads devices announced are awaited this long at
                                    #   most (0: not at all); docs/results/demo-defaults.md
    max_update_bytes = 67108864     # larger update blobs are refused (devices check before sending)
    norm_bound = 50.0               # explicit L2 bound on an update's deltas (default: automatic)
    norm_policy = "reject"          # or "clip": scale an update down to the bound
    norm_auto = 10.0                # no norm_bound: bound = norm_auto x median of the recent accepted
    norm_window = 50                #   norms (the last norm_window), or norm_auto x the model's own
    norm_warmup = 3                 #   norm until norm_warmup norms were accepted; 0 = no bound
    max_samples = 100000            # an update's aggregation weight is min(num_samples, max_samples)
    max_malformed = 3               # a device refused this often in a round is cut off for the round
    queue_bytes = 268435456         # received messages waiting for the worker, all senders ...
    queue_sender_bytes = 100663296  # ... and one sender (more is dropped, counted queue_full)
    value_codec = "fp32"            # what devices upload with (fp32 is lossless)
    compress = false                # zstd on uploads
    mode = "sync"                   # or "async": buffered asynchronous rounds (docs/explanation/async-rounds.md)
    buffer = 8                      # async: accepted updates per new model version
    max_staleness = "auto"          # async: updates trained more versions ago are refused (counter stale);
                                    #   auto: ceil(24 x concurrency / buffer) (flayer.engine.versions)
    staleness = "sqrt"              # async: deltas weighted 1/sqrt(1+s); "inverse" 1/(1+s); "constant" 1
    concurrency = "auto"            # async: devices training at once (0: every device online);
                                    #   auto: ceil(over_selection x buffer)
    delta_downloads = "off"         # or exact | fp16 | int8: publish the change from the previous model too
    fit_lowest_codec = "int8"       # devices with [edge] upload = "fit" may go down to this codec ...
    fit_min_keep = 0.1              # ... and send no less than this share of their masked coordinates
    metrics_port = 9464             # Prometheus metrics at http://metrics_host:PORT/metrics (0: a free port;
                                    #   left out: none); docs/howto/service.md
    metrics_host = "127.0.0.1"      # another address needs a token: metrics_token_file, else one generated
    metrics_token_file = ""         #   into STATE_DIR/metrics.token (rule of docs/howto/watch-fleet.md)
    metrics_linger_s = 0.0          # after the last round, wait up to this long for one more scrape
    models_dir = ""                 # models over HTTP: write each model and delta here as <sha256> ...
    models_url = ""                 # ... which a web server serves at this URL (docs/howto/http-models.md)

    [run]      strategy, rounds, seed            (as for flayer simulate)
    [data]     dataset (and model): the model spec, without loading any data
    [model]    the federation's own model (instead of [data]), see flayer.registry:
               name = "cnn" | "resnet18" | "fasttext" | "package.module:build"
               args = {...}                 # keyword arguments of an entry point
               classes = ["cat", "dog"]     # class names in label order (num_classes follows)
               in_channels, height, width   # the image input every device resizes to
               mean, std                    # normalisation after scaling pixels to [0, 1]
               initial_model = "pretrained.safetensors"   # start from a checkpoint
               python_path = ["."]          # folders searched for the entry point's module
    [train]    lr, batch_size, local_epochs     (sent to the devices in the round plan)
    [strategy.<name>]  the strategy's options   (sent in the plan: scalars only)
    [privacy]  client-level differential privacy (docs/explanation/privacy.md); population is required

Every key is checked; errors name the file, the table and the key.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from flayer.config import ConfigError, RunConfig, add_python_path, from_mapping, load_run_config, read_toml
from flayer.engine.secure_plan import MIN_COHORT
from flayer.engine.versions import AUTO, AsyncSettings, resolve_async
from flayer.registry import ModelError, with_fingerprint
from flayer.spec import ModelSpec, canonical_args, canonical_classes
from protocol import VALUE_CODECS
from protocol.model_delta import DELTA_MODES
from protocol.model_url import models_url_problem
from protocol.upload_cap import UploadCap

__all__ = ["DATASET_INPUTS", "CoordinatorConfig", "FederationSettings", "load_coordinator_config", "model_spec_for"]

# (channels, height, width, classes) of the image data sets as their loaders return them
DATASET_INPUTS: dict[str, tuple[int, int, int, int]] = {
    "fmnist": (1, 28, 28, 10), "mnist": (1, 28, 28, 10), "digits": (1, 16, 16, 10),
    "cifar10": (3, 32, 32, 10), "cifar100": (3, 32, 32, 100), "tiny-imagenet": (3, 64, 64, 200),
}


@dataclass(frozen=True)
class FederationSettings:
    credentials: str = ""
    state_dir: str = "runs/federation"
    quorum: int = 1
    over_selection: float = 1.3
    min_devices: int = 1
    deadline_s: float = 600.0
    grace_s: float = 5.0
    min_updates: int = 1
    extend_s: float = 0.0
    announce_wait_s: float = 10.0  # sync: the close waits this long at most for uploads devices announced (coordinator.rounds)
    max_update_bytes: int = 64 * 2**20
    norm_bound: float | None = None
    norm_policy: Literal["reject", "clip"] = "reject"
    value_codec: str = "fp32"
    compress: bool = False
    stale_after_s: float = 90.0  # a device whose last status is older is offline
    keep_journals: int = 3  # journals of finished rounds kept beside the checkpoint
    max_pending_bytes: int = 1 << 30  # unfinished update chunks held in memory
    publish_timeout_s: float = 120.0  # waiting for the broker's PUBACKs of a model
    calibration_s: float = 300.0  # round 0 (calibration) deadline, for strategies that need one
    norm_auto: float = 10.0  # automatic norm bound: a multiple of the recent accepted norms (0: off)
    norm_window: int = 50
    norm_warmup: int = 3
    max_samples: int = 100_000  # cap on the aggregation weight an update claims
    max_malformed: int = 3  # refusals of one device in one round before it is cut off for that round
    queue_bytes: int = 256 * 2**20  # the receive queue between the MQTT callbacks and the worker
    queue_sender_bytes: int = 96 * 2**20  # one sender's share of it
    delta_downloads: str = "off"  # publish the change from the previous model too: off, exact, fp16 or int8
    fit_lowest_codec: str = "int8"  # the lowest value codec devices with [edge] upload = "fit" may choose
    fit_min_keep: float = 0.1  # the least share of their masked coordinates such devices may send
    revoked_file: str = ""  # 'flayer broker revoke' list; default: revoked.json of the credentials' broker folder
    mode: Literal["sync", "async"] = "sync"  # async: buffered asynchronous rounds (flayer.engine.versions)
    buffer: int = 8  # async: accepted updates per new model version
    max_staleness: int | Literal["auto"] = AUTO  # async: versions an update may lag the current one
    staleness: Literal["sqrt", "inverse", "constant"] = "sqrt"  # async: the staleness weight of an update
    concurrency: int | Literal["auto"] = AUTO  # async: devices training at once (0: every device online)
    metrics_port: int | None = None  # Prometheus endpoint (coordinator.exporter); None: none, 0: a free port
    metrics_host: str = "127.0.0.1"
    metrics_token_file: str = ""  # off loopback: the token scrapers present (default: STATE_DIR/metrics.token)
    metrics_linger_s: float = 0.0  # after the last round: wait this long at most for a scrape of the final values
    models_dir: str = ""  # models over HTTP: the folder each model and delta is written into as <sha256> (relative: to this file)
    models_url: str = ""  # models over HTTP: the URL a web server serves models_dir at (http or https); the plan names it

    def __post_init__(self) -> None:
        if not self.credentials:
            raise ConfigError("credentials: the coordinator's credentials file is required "
                              "(written by 'flayer broker start': <state>/credentials/coordinator.toml)")
        if self.quorum < 1 or self.min_devices < 1 or self.min_updates < 1:
            raise ConfigError("quorum, min_devices and min_updates must be >= 1")
        if self.min_devices < self.quorum:
            raise ConfigError(f"min_devices ({self.min_devices}) must be >= quorum ({self.quorum})")
        if not 1.0 <= self.over_selection <= 10.0:
            raise ConfigError(f"over_selection must be in [1, 10], got {self.over_selection}")
        for name in ("deadline_s", "publish_timeout_s", "stale_after_s", "calibration_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.grace_s < 0 or self.extend_s < 0:
            raise ConfigError("grace_s and extend_s must be >= 0")
        if not (0 <= self.announce_wait_s and math.isfinite(self.announce_wait_s)):
            raise ConfigError(f"announce_wait_s must be a finite number >= 0 (the deadline bounds the wait in any "
                              f"case), got {self.announce_wait_s}")
        if self.max_update_bytes < 1 or self.max_pending_bytes < self.max_update_bytes:
            raise ConfigError(f"max_update_bytes must be >= 1 and max_pending_bytes ({self.max_pending_bytes}) "
                              f">= max_update_bytes ({self.max_update_bytes})")
        if self.norm_bound is not None and not (self.norm_bound > 0 and math.isfinite(self.norm_bound)):
            raise ConfigError(f"norm_bound must be a positive number (leave it out for none), got {self.norm_bound}")
        if self.value_codec not in VALUE_CODECS:
            raise ConfigError(f"value_codec must be one of {', '.join(VALUE_CODECS)}, got {self.value_codec!r}")
        if self.delta_downloads not in DELTA_MODES:
            raise ConfigError(f"delta_downloads must be one of {', '.join(DELTA_MODES)}, got {self.delta_downloads!r}")
        if (problem := UploadCap(self.fit_lowest_codec, self.fit_min_keep).problems()) is not None:
            raise ConfigError(f"fit_lowest_codec / fit_min_keep: {problem}")
        if not (self.norm_auto >= 0 and math.isfinite(self.norm_auto)):
            raise ConfigError(f"norm_auto must be >= 0 (0: no automatic bound), got {self.norm_auto}")
        if self.norm_window < 1 or self.norm_warmup < 1 or self.norm_warmup > self.norm_window:
            raise ConfigError(f"need 1 <= norm_warmup ({self.norm_warmup}) <= norm_window ({self.norm_window})")
        if self.max_samples < 1 or self.max_malformed < 1:
            raise ConfigError("max_samples and max_malformed must be >= 1")
        if not 1 <= self.queue_sender_bytes <= self.queue_bytes:
            raise ConfigError(f"need 1 <= queue_sender_bytes ({self.queue_sender_bytes}) <= queue_bytes "
                              f"({self.queue_bytes})")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port must be a TCP port (0: a free one), got {self.metrics_port}")
        if not (0 <= self.metrics_linger_s < float("inf")) or not self.metrics_host:
            raise ConfigError(f"metrics_linger_s must be a finite number >= 0 (got {self.metrics_linger_s}) and "
                              f"metrics_host an address (got {self.metrics_host!r})")
        if bool(self.models_dir) != bool(self.models_url):
            raise ConfigError(f"models_dir and models_url go together (a folder and the URL a web server serves it "
                              f"at), got models_dir = {self.models_dir!r} and models_url = {self.models_url!r}")
        if (problem := models_url_problem(self.models_url)) is not None:
            raise ConfigError(f"models_url {problem}, got {self.models_url!r}")
        if self.keep_journals < 1:
            raise ConfigError(f"keep_journals must be >= 1, got {self.keep_journals}")
        try:
            self.async_settings  # noqa: B018 -- validates buffer, max_staleness, staleness, concurrency
        except (TypeError, ValueError) as exc:
            raise ConfigError(str(exc)) from None

    @property
    def async_settings(self) -> AsyncSettings:
        """The asynchronous settings in force, ``"auto"`` resolved without knowing the fleet
        (:func:`flayer.engine.versions.resolve_async`; :meth:`resolved` for a known fleet)."""
        return self.resolve_async()[0]

    def resolve_async(self, fleet: int | None = None) -> tuple[AsyncSettings, dict[str, str]]:
        """(settings in force, how each ``"auto"`` one was derived): ``fleet`` is the number of devices
        when the driver knows it (``flayer emulate``), None for the coordinator."""
        return resolve_async(self.buffer, self.max_staleness, self.staleness, self.concurrency, self.over_selection,
                             fleet)

    @property
    def staleness_bound(self) -> int:
        """``max_staleness`` as a number (resolved settings hold one; ``"auto"`` is resolved without the fleet)."""
        m = self.max_staleness
        return m if isinstance(m, int) else self.async_settings.max_staleness

    def resolved(self, fleet: int | None = None) -> FederationSettings:
        """These settings with ``max_staleness`` and ``concurrency`` as numbers (``"auto"`` resolved)."""
        a = self.resolve_async(fleet)[0]
        return dataclasses.replace(self, max_staleness=a.max_staleness, concurrency=a.concurrency)


@dataclass(frozen=True)
class CoordinatorConfig:
    federation: FederationSettings
    run: RunConfig
    spec: ModelSpec
    credentials: Path  # resolved
    state_dir: Path  # resolved
    initial_model: Path | None = None  # resolved; the first global model instead of a fresh one
    revoked_file: Path | None = None  # resolved
    metrics_token_file: Path | None = None  # resolved
    models_dir: Path | None = None  # resolved; models over HTTP (coordinator.model_files)
    keys_file: Path | None = None  # the devices' public keys: signing_keys.json of the credentials' broker folder

    @property
    def options(self) -> Mapping[str, Any]:
        return self.run.options()

    @property
    def train_plan(self) -> dict[str, Any]:
        """The training settings every device uses (the rest of [train] is per device)."""
        t = self.run.train
        return {"lr": t.lr, "batch_size": t.batch_size, "local_epochs": t.local_epochs}


def model_spec_for(dataset: str, model: str | None = None) -> ModelSpec:
    """The model spec ``flayer simulate`` builds for ``dataset`` (without loading the data)."""
    if dataset not in DATASET_INPUTS:
        raise ConfigError(f"the model of data set {dataset!r} depends on its files (vocabulary size); give an "
                          f"explicit [model] table (name, num_classes, vocab_size, ...)")
    c, h, w, k = DATASET_INPUTS[dataset]
    name = model or "cnn"
    if name == "fasttext":
        raise ConfigError(f"{dataset} is an image data set: 'fasttext' needs text")
    try:
        return ModelSpec(name=name, in_channels=c, height=h, width=w, num_classes=k)
    except ValueError as exc:
        raise ConfigError(f"[data] model: {exc}") from exc


def model_spec_from_table(table: Mapping[str, Any], where: str, base: Path) -> tuple[ModelSpec, Path | None]:
    """The [model] table: a ModelSpec (its fingerprint filled in, after building the model once) and
    the resolved ``initial_model`` path."""
    fields = dict(table)
    initial = fields.pop("initial_model", None)
    add_python_path(fields.pop("python_path", []), base, where)
    try:
        if "args" in fields:
            fields["args"] = canonical_args(fields["args"], f"{where} args")
        if "classes" in fields:
            names = fields["classes"]
            fields["classes"] = canonical_classes(names, f"{where} classes")
            fields.setdefault("num_classes", len(names))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    spec = from_mapping(ModelSpec, fields, where)
    try:
        spec = with_fingerprint(spec)
    except ModelError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    if initial is None:
        return spec, None
    if not isinstance(initial, str) or not initial:
        raise ConfigError(f"{where} initial_model must be the path of a .safetensors file, got {initial!r}")
    from flayer.registry import build_model
    from flayer.state import StateFileError, load_initial_model

    path = _resolve(base, initial)
    try:
        load_initial_model(path, build_model(spec))
    except StateFileError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return spec, path


def _scalar_options(options: Mapping[str, Any], where: str) -> None:
    for key, value in options.items():
        if not isinstance(value, (str, int, float, bool)):
            raise ConfigError(f"{where}.{key}: {value!r} cannot travel in the round plan (strings, numbers and "
                              f"booleans only)")


def _resolve(base: Path, value: str) -> Path:
    p = Path(value).expanduser()
    return (p if p.is_absolute() else base / p).resolve()


def load_coordinator_config(path: str | Path, overrides: Mapping[str, Mapping[str, Any]] | None = None
                            ) -> CoordinatorConfig:
    """Read and validate ``federation.toml``; ``overrides`` as for :func:`flayer.config.load_run_config`
    plus a ``federation`` table (command-line flags win over the file)."""
    path = Path(path)
    raw = read_toml(path)
    unknown = sorted(set(raw) - {"federation", "model", "run", "data", "train", "strategy", "privacy"})
    if unknown:
        raise ConfigError(f"{path}: unknown table(s) {', '.join(unknown)}; known: federation, run, data, model, "
                          f"train, strategy, privacy")
    fed_table = {**raw.get("federation", {}), **{k: v for k, v in (overrides or {}).get("federation", {}).items()
                                                 if v is not None}}
    fed = from_mapping(FederationSettings, fed_table, f"{path} [federation]")
    run_tables: dict[str, Any] = {k: raw.get(k, {}) for k in ("run", "data", "train", "privacy")}
    run_tables["strategy"] = raw.get("strategy", {})
    for table, values in (overrides or {}).items():
        if table != "federation":
            run_tables[table] = {**run_tables.get(table, {}), **{k: v for k, v in values.items() if v is not None}}
    try:
        run = load_run_config(None, run_tables)
    except ConfigError as exc:
        raise ConfigError(str(exc).replace("flags", str(path), 1)) from None
    if run.seed < 0:
        raise ConfigError(f"{path} [run] seed must be >= 0 (it travels in the round plan), got {run.seed}")
    if run.privacy.secure_aggregation and fed.mode == "async":
        raise ConfigError(f"{path} [privacy] secure_aggregation needs synchronous rounds (mode = \"sync\"): a secure "
                          f"sum is unmasked once per round, over the devices that shared their keys "
                          f"(docs/explanation/secure-aggregation.md)")
    if run.privacy.secure_aggregation and 3 * run.privacy.secure_stage_s > fed.deadline_s:
        raise ConfigError(f"{path} [privacy] secure_stage_s = {run.privacy.secure_stage_s:g}: the key, share and "
                          f"unmask stages may each take it, which must fit in [federation] deadline_s = "
                          f"{fed.deadline_s:g} (3 x secure_stage_s <= deadline_s)")
    if run.privacy.enabled and fed.value_codec != "fp32":
        raise ConfigError(f"{path} [federation] value_codec = {fed.value_codec!r} with [privacy]: a lossy codec moves an "
                          f"honest device's clipped upload past C, and the coordinator's count of the updates it "
                          f"clips again (in the round records) would say whose; use \"fp32\"")
    if run.privacy.secure_aggregation and fed.quorum < MIN_COHORT:
        raise ConfigError(f"{path} [privacy] secure_aggregation needs [federation] quorum >= {MIN_COHORT}: devices "
                          f"refuse a smaller secure round (a sum of a device and one colluder is that device's "
                          f"update; docs/explanation/secure-aggregation.md)")
    base = path.resolve().parent
    initial: Path | None = None
    if "model" in raw:
        spec, initial = model_spec_from_table(raw["model"], f"{path} [model]", base)
    else:
        try:
            spec = with_fingerprint(model_spec_for(run.data.dataset, run.data.model))
        except ModelError as exc:
            raise ConfigError(f"{path} [data] model: {exc}") from None
    _scalar_options(run.options(), f"{path} [strategy.{run.strategy}]")
    from flayer.strategies import STRATEGIES

    if run.strategy not in STRATEGIES:
        raise ConfigError(f"{path} [run] strategy {run.strategy!r} is not available in this build; available: "
                          f"{', '.join(sorted(STRATEGIES))}")
    creds = _resolve(base, fed.credentials)
    revoked = _resolve(base, fed.revoked_file) if fed.revoked_file else creds.parent.parent / "revoked.json"
    token = _resolve(base, fed.metrics_token_file) if fed.metrics_token_file else None
    models = _resolve(base, fed.models_dir) if fed.models_dir else None
    state = _resolve(base, fed.state_dir)
    for what, kept in (("state_dir (the journals hold every device's update)", state),
                       ("the credentials file (the coordinator's password and signing key)", creds)):
        if models is not None and (models == kept.resolve() or models in kept.resolve().parents):
            raise ConfigError(f"{path} [federation] models_dir {models} would serve {what} to every device over "
                              f"HTTP: give it a folder of its own")
    return CoordinatorConfig(fed, run, spec, creds, state, initial, revoked, token, models,
                             creds.parent.parent / "signing_keys.json")


def describe(cfg: CoordinatorConfig) -> dict[str, Any]:
    """A JSON-able view (for the state folder and the summary)."""
    return {"federation": dataclasses.asdict(cfg.federation), "strategy": cfg.run.strategy,
            "rounds": cfg.run.rounds, "seed": cfg.run.seed, "train": cfg.train_plan,
            "options": dict(cfg.options), "model": dataclasses.asdict(cfg.spec)}
