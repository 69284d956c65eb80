"""The coordinator's share of a private federation (docs/explanation/privacy.md): the round's DP parameters
for the plan, the accountant's ledgers, the budget check before a round opens, and what the checkpoint keeps.

Rules, in the order the coordinator applies them:

1. At the start: ``[privacy]`` is resolved for the population N (``[privacy] population``: required, the
   coordinator cannot know how many devices may ever join), the expected contributions m (default: the
   quorum, synchronous; the buffer, asynchronous) and delta (default min(1e-5, 1/(10 N))); the strategy is
   made private (:func:`flayer.engine.privacy.private_strategy`). A setting that cannot hold stops the
   start; a population or an epsilon too weak to protect much is logged as a warning.
2. Before a round (or model version) opens: if composing it would bring epsilon (against readers of the
   models and plans) above ``target_epsilon``, or if more devices have reported than ``population`` and
   delta is 1/(that count) or more, the federation ends here (the final model is published) with
   the reason in the log and the metrics. A local-mode round is checked at the fewest uploads it may close
   with (``min_updates``): its noise is that of the shares that arrive.
3. Each round: the plan carries C, z and m (:class:`flayer.engine.privacy.RoundPrivacy`); every update is
   clipped again to the server bound; the sum is noised from the operating system's CSPRNG.
3a. With a participation schema (``[privacy] max_participations`` k, ``min_separation`` b) the cohort is drawn
   from the online devices the schema still allows (:func:`flayer.engine.selection.eligible` over the earlier
   plans' cohorts, kept in the checkpoint); fewer than the quorum of them online while enough devices
   are online: the federation ends with the reason (waiting would not help -- the rounds that free a device
   from its separation are the ones that cannot open). The plan carries k and b (signed with it), so each
   device checks them against its own ledger and its pinned floor (edge_client.budget).
4. At the close: the round is composed at q = 1 (the cohort is public) with the noise it actually carries,
   against each adversary (:class:`flayer.engine.adversaries.Accounts`); adaptive clipping moves C; the
   ledgers and C go into the same atomic checkpoint as the model, so a restart neither forgets a round nor
   composes one twice.
5. The next model is the server step on the noised average (``server_lr``, ``server_momentum``:
   :class:`flayer.engine.server_step.ServerStep`, the simulator's code; post-processing, no epsilon); its
   velocity goes into the checkpoint with the ledgers.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from flayer.engine.accountant import LedgerError
from flayer.engine.adversaries import Accounts
from flayer.engine.privacy import RoundPrivacy, next_clip, private_strategy
from flayer.engine.round import OpenAggregate
from flayer.engine.selection import eligible
from flayer.engine.server_step import ServerStep
from flayer.privacy_config import PrivacySettings
from flayer.strategies.base import Strategy
from protocol.metrics_schema import epsilon_value

__all__ = ["FederationPrivacy", "PrivacyStateError", "federation_privacy"]

log = logging.getLogger(__name__)


class PrivacyStateError(ValueError):
    """The checkpoint's privacy state is malformed."""


@dataclass
class FederationPrivacy:
    settings: PrivacySettings  # resolved
    asynchronous: bool
    clip: float = 0.0
    fewest: int = 1  # the fewest uploads a round may close with (min_updates)
    accounts: Accounts = field(default_factory=lambda: Accounts("central", False))
    z: float = 0.0  # the multiplier of the last closed round's sum
    taken: dict[str, list[int]] = field(default_factory=dict)  # the schema's history: device -> rounds selected
    void: set[int] = field(default_factory=set)  # secure rounds abandoned before their unmasking (the plans' secure.void)
    step: ServerStep = field(default_factory=ServerStep)  # rule 5: the server step on the noised average
    _warned_population: bool = False

    @classmethod
    def of(cls, settings: PrivacySettings, strategy: Strategy, quorum: int, buffer: int,
           asynchronous: bool, fewest: int = 1, rounds: int = 0) -> tuple[FederationPrivacy | None, Strategy]:
        """(the federation's privacy, None when off; the strategy as private rounds run it); ValueError
        naming the setting that cannot hold (rule 1)."""
        if settings.schema.active and not settings.enabled:
            raise ValueError("max_participations / min_separation bound a private federation's epsilon; they need "
                             "enabled = true")
        if not settings.enabled:
            return None, strategy
        if settings.banded:  # its stream would have to live in the journal and checkpoint, and restart with them
            raise ValueError("noise_kind = \"banded\" runs in flayer simulate only: the coordinator draws independent "
                             "noise each round; leave noise_kind unset (docs/explanation/privacy.md, \"Correlated "
                             "noise\")")
        if settings.population is None:
            raise ValueError("[privacy] population is required for the coordinator: the number of devices that may "
                             "be selected (N of delta < 1/N)")
        if asynchronous and settings.schema.active:
            raise ValueError("max_participations / min_separation need synchronous rounds (mode = \"sync\"): "
                             "asynchronous slots are not drawn round by round")
        private = private_strategy(strategy)
        s = settings.resolve(settings.population, buffer if asynchronous else quorum)
        if not asynchronous and (s.expected_contributions or 0) > quorum:  # devices refuse m above their cohort
            raise ValueError(f"expected_contributions {s.expected_contributions} exceeds the quorum {quorum}: a "
                             f"synchronous round may select as few as quorum devices, and a device refuses a plan "
                             f"whose m exceeds the devices it selects (its noise share z C / sqrt(m) would shrink)")
        out = cls(s, asynchronous, s.clip, max(1, fewest),
                  Accounts(s.mode, s.secure_aggregation, most=s.max_participations))
        out.step = ServerStep(float(s.server_lr), s.server_momentum)  # resolved: "auto" is a number here
        if rounds > 0:
            for line in s.warnings(out.accounts.public.epsilon_after(s.noise_multiplier, 1.0, out.delta, rounds,
                                                                     s.max_participations), rounds):
                log.warning("privacy: %s", line)
        return out, private

    @property
    def delta(self) -> float:
        assert self.settings.delta is not None
        return self.settings.delta

    def round(self, asked: int) -> RoundPrivacy:
        """This round's parameters (rule 3); ``asked``: the devices it selects."""
        return RoundPrivacy.of(self.settings, self.clip)

    def eligible(self, online: list[str], number: int) -> list[str]:
        """Rule 3a: the devices of ``online`` the participation schema lets take part in round ``number``."""
        if not self.settings.schema.active:
            return online
        return eligible(sorted(online), self.taken, self.settings.schema, number, self.void)

    def schema_stop(self, eligible_online: int, needed: int, number: int) -> str | None:
        """Rule 3a: why the federation ends before round ``number`` (too few devices the schema allows), or None."""
        if not self.settings.schema.active or eligible_online >= needed:
            return None
        sc = self.settings.schema
        return (f"participation schema: round {number} has {eligible_online} online device(s) that may take part "
                f"(max_participations {sc.most}, min_separation {sc.separation}), fewer than the quorum {needed}; "
                f"the federation ends after round {number - 1}")

    def selected(self, number: int, devices: Any) -> None:
        """Note round ``number``'s cohort in the schema's history (idempotent: a replayed plan counts once)."""
        for d in devices:
            rounds = self.taken.setdefault(str(d), [])
            if number not in rounds:
                rounds.append(number)
                rounds.sort()

    def abandoned(self, number: int) -> None:
        """Secure round ``number`` was abandoned before any consent was asked (the next plans name it in
        ``secure.void``): its cohort's selections no longer count toward max_participations (rule 3a)."""
        self.void.add(int(number))

    def over_budget(self, number: int, asked: int) -> str | None:
        """Rule 2: why round ``number`` must not open, or None."""
        target = self.settings.target_epsilon
        if target is None:
            return None
        z = self.accounts.worst_z(RoundPrivacy.of(self.settings, self.clip), self.fewest)
        eps = self.accounts.public_after(z, self.delta)
        if eps <= target:
            return None
        return (f"privacy budget: round {number} would bring epsilon to {eps:.3f} > target_epsilon {target:g} at "
                f"delta {self.delta:.3g}; the federation ends after round {number - 1} with epsilon "
                f"{self.epsilon():.3f}")

    def population_problem(self, reported: int) -> str | None:
        """Rule 2 too: why no private round may open once ``reported`` devices have reported -- more than the
        ``population`` N the delta was checked against, so that delta is 1/``reported`` or more -- or None. More
        devices than N with delta still below 1/``reported`` is logged once as a warning."""
        n = self.settings.population
        if n is None or reported <= n:
            return None
        if self.delta >= 1.0 / reported:
            return (f"privacy: {reported} devices have reported, more than [privacy] population = {n}, and delta "
                    f"{self.delta:.3g} >= 1/{reported}: at delta >= 1/N a mechanism that publishes one device's data "
                    f"whole satisfies the guarantee; the federation ends (set population to the devices that may "
                    f"take part)")
        if not self._warned_population:
            self._warned_population = True
            log.warning("privacy: %d devices have reported, more than [privacy] population = %d; delta %.3g is "
                        "still below 1/%d", reported, n, self.delta, reported)
        return None

    def withheld(self, agg: OpenAggregate) -> str | None:
        """Rule 2 at the close: why a local-mode round that closes short -- fewer uploads than ``min_updates``,
        after its extension -- must not be published: its sum carries only the shares that arrived, and composing
        it would bring epsilon above ``target_epsilon`` (the check before the round assumed ``min_updates``).
        None: publish it. The caller then folds nothing (:meth:`OpenAggregate.withhold`); the coordinator, which
        read the uploads, still composes them in its own ledger."""
        rp, target = agg.privacy, self.settings.target_epsilon
        if rp is None or rp.mode != "local" or rp.ring or target is None:
            return None
        arrived = agg.tally.accepted
        if arrived <= 0 or arrived >= self.fewest:
            return None
        eps = self.accounts.public_after(self.accounts.round_z(rp, arrived), self.delta)
        if eps <= target:
            return None
        return (f"privacy budget: the round closed with {arrived} of the {self.fewest} uploads min_updates asks; its "
                f"sum would bring epsilon to {eps:.3f} > target_epsilon {target:g}: nothing of it is published")

    def close(self, agg: OpenAggregate) -> dict[str, Any]:
        """Rule 4: compose the closed round, adapt C; the round record's privacy fields."""
        clip = self.clip
        assert agg.privacy is not None
        self.z = self.accounts.compose(agg.privacy, agg.tally.accepted)
        if self.settings.clipping == "adaptive" and agg.tally.accepted > 0:  # C moves only after a folded round
            self.clip = next_clip(self.clip, agg.noised_bits(), self.settings.expected_contributions or 1,
                                  self.settings.target_quantile, self.settings.clip_lr)
        eps = self.accounts.epsilons(self.delta)
        return {"epsilon": epsilon_value(eps["public"]), "epsilon_coordinator": epsilon_value(eps["coordinator"]),
                "delta": self.delta, "dp_clip": clip, "dp_noise_multiplier": self.z, "dp_sample_rate": 1.0,
                "dp_max_participations": self.settings.max_participations,
                "dp_min_separation": self.settings.min_separation,
                "dp_rounds": self.accounts.public.rounds}  # composed: an abandoned secure round's sum was never revealed

    def epsilon(self) -> float:
        """Against readers of the published models, devices and observers (docs/explanation/privacy.md)."""
        return self.accounts.public_epsilon(self.delta)

    def state(self) -> dict[str, Any]:
        """What the checkpoint keeps: the composed rounds as ``[z, q, rounds]`` runs and the clip bound."""
        out = {**self.accounts.state(), "clip": self.clip}
        if not self.step.plain:
            out["server_step"] = self.step.state()
        if self.settings.schema.active:
            out["participations"] = {d: list(r) for d, r in sorted(self.taken.items())}
            out["void_rounds"] = sorted(self.void)
        return out

    def restore(self, raw: Mapping[str, Any], rounds_done: int) -> None:
        """From a checkpoint after round ``rounds_done`` (PrivacyStateError when it does not add up)."""
        if not raw:
            if rounds_done > 0:
                raise PrivacyStateError(f"the checkpoint after round {rounds_done} holds no privacy ledger: it was "
                                        f"written without [privacy]; use another state_dir")
            return
        try:
            accounts, sampled = Accounts.restore(self.settings.mode, self.settings.secure_aggregation, raw)
        except LedgerError as exc:
            raise PrivacyStateError(str(exc)) from None
        clip = raw.get("clip")
        if not isinstance(clip, (int, float)) or isinstance(clip, bool) or not (math.isfinite(clip) and clip > 0):
            raise PrivacyStateError(f"checkpoint: privacy clip must be a number > 0, got {clip!r}")
        # a closed round (or asynchronous version) composes at most once: never more than were done
        if accounts.public.rounds > rounds_done:
            what = "model version" if self.asynchronous else "round"
            raise PrivacyStateError(f"checkpoint: the privacy ledger composes {accounts.public.rounds} rounds, the "
                                    f"checkpoint is after {what} {rounds_done}")
        if sampled:
            log.warning("privacy: the checkpoint's ledger composed rounds with amplification by sampling; they are "
                        "recomposed at q = 1 (the cohort is public)")
        taken = raw.get("participations", {})
        if not isinstance(taken, dict) or not all(
                isinstance(d, str) and isinstance(rs, list) and all(isinstance(r, int) and not isinstance(r, bool)
                                                                   and 1 <= r <= rounds_done for r in rs)
                for d, rs in taken.items()):
            raise PrivacyStateError("checkpoint: participations must map device ids to the rounds (1 .. the "
                                    "checkpoint's) they were selected in")
        void = raw.get("void_rounds", [])
        if not isinstance(void, list) or not all(isinstance(r, int) and not isinstance(r, bool)
                                                 and 1 <= r <= rounds_done for r in void):
            raise PrivacyStateError("checkpoint: void_rounds must list rounds (1 .. the checkpoint's) abandoned before "
                                    "their unmasking")
        if self.settings.schema.active and rounds_done > 0 and "participations" not in raw:
            raise PrivacyStateError("checkpoint: written without a participation schema; the schema cannot be applied "
                                    "to rounds whose cohorts it does not hold (use another state_dir)")
        try:
            self.step.load(raw.get("server_step", {}))
        except ValueError as exc:
            raise PrivacyStateError(f"checkpoint: {exc}") from None
        accounts.most = self.settings.max_participations
        self.accounts, self.clip = accounts, float(clip)
        self.taken, self.void = {d: sorted(set(rs)) for d, rs in taken.items()}, set(void)
        log.info("privacy: resuming with %d rounds composed, epsilon %.4g at delta %.3g", accounts.public.rounds,
                 self.epsilon(), self.delta)


def federation_privacy(cfg: Any, strategy: Strategy, buffer: int) -> tuple[FederationPrivacy | None, Strategy]:
    """:meth:`FederationPrivacy.of` for a coordinator config (``buffer``: the resolved asynchronous buffer);
    CoordinatorError naming the setting that cannot hold."""
    from .result import CoordinatorError

    try:
        return FederationPrivacy.of(cfg.run.privacy, strategy, cfg.federation.quorum, buffer,
                                    cfg.federation.mode == "async", cfg.federation.min_updates, cfg.run.rounds)
    except ValueError as exc:
        raise CoordinatorError(f"[privacy]: {exc}") from None
