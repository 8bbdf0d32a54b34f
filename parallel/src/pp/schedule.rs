//! Pipeline schedules as data: for every pipeline rank, the ordered list of [`Action`]s it runs
//! for one optimiser step.
//!
//! # Model
//!
//! There are `pp` pipeline ranks, `v` virtual stages (model chunks) per rank and `m`
//! micro-batches. The model is cut into `S = pp·v` stages; rank `r` holds the stages
//! `r, r + pp, …, r + (v−1)·pp`, so the global stage of local chunk `c` on rank `r` is
//! `s = c·pp + r`. Stage 0 owns the embedding, stage `S − 1` computes the loss.
//!
//! Activations flow from stage `s` to `s + 1`, gradients from `s + 1` back to `s`. With `pp ≥ 2`
//! neighbouring stages always live on different ranks and every hand-over is an explicit
//! send/receive pair. With `pp = 1` all stages share rank 0, outputs are handed over in memory
//! and the schedule contains no communication at all.
//!
//! # Where communication sits
//!
//! Each compute action carries its own communication with it: a forward of stage `s > 0` is
//! immediately preceded by the receive of its input activation, and a forward of stage
//! `s < S − 1` is immediately followed by the send of its output. Likewise a backward of stage
//! `s < S − 1` is preceded by the receive of its output gradient and a backward of stage `s > 0`
//! is followed by the send of its input gradient. An executor runs the list top to bottom.
//!
//! The lists are deadlock-free when sends are *buffered* (a send returns once the message is
//! queued, as wildfire's transport does); [`check`](crate::pp::check::check) verifies this by
//! simulating all ranks. With rendezvous (blocking) sends only GPipe, and the trivial cases
//! `pp = 1` or `m = 1`, stay deadlock-free: in 1F1B two neighbours reach "send activation" and
//! "send gradient" to each other at the same time. An executor over a blocking transport must
//! post a send together with the receive that follows it (batched send/receive), which is
//! equivalent to buffered semantics.
//!
//! # Orders
//!
//! Each rank works through `n = ⌈m/pp⌉·pp·v` forward *slots* and as many backward slots. Slot
//! `g·pp·v + i·pp + j` holds micro-batch `g·pp + j`: micro-batches come in groups of `pp`, and a
//! group runs chunk by chunk (chunk `i` for forwards, `v − 1 − i` for backwards). When
//! `pp ∤ m` the last group is padded: slots of micro-batches `≥ m` are empty and are dropped
//! from the final list. With `v = 1` the slots are simply the micro-batches in ascending order.
//!
//! Every kind then uses one merge rule with a warm-up `w_r`: run forward slots `0..w_r`, then
//! alternate forward slot `w_r + i` and backward slot `i` until the forwards run out, then the
//! remaining backward slots (cool-down).
//!
//! | kind          | warm-up `w_r` on rank `r`    |
//! |---------------|------------------------------|
//! | `gpipe`       | `n` (all forwards first)     |
//! | `1f1b`        | `pp − 1 − r`                 |
//! | `interleaved` | `(pp − 1 − r) + (v − 1)·pp`  |
//!
//! (`w_r ≥ n` simply means all forwards first.)
//!
//! With `v = 1` interleaved is exactly 1F1B. Megatron-LM's interleaved schedule warms up
//! `2·(pp − 1 − r) + (v − 1)·pp`; with each receive placed right before its use the smaller
//! warm-up above is enough (proof below), and in the checker's timed simulation it has the
//! same bubble with fewer stored activations.
//!
//! ## Why 1F1B and interleaved cannot deadlock
//!
//! Give forward slot `k` on rank `r` the time `2k + r` and backward slot `j` the time
//! `2j + 2·v·pp − 1 − r`. Every dependency then points strictly forward in time:
//! an activation from rank `r` to `r + 1` (same slot) arrives `+1` later; from rank `pp − 1`,
//! chunk `c` to rank 0, chunk `c + 1` (slot `k + pp`) `pp + 1` later; gradients mirror this; the
//! last stage's backward runs 1 after its forward. The merge rule is exactly "sort each rank's
//! slots by time" (forward `k` precedes backward `j` iff `k ≤ j + w_r`). So running every
//! action of every rank in global time order is a valid execution, for every `pp`, `v` and `m`,
//! and empty slots only remove actions. GPipe is acyclic trivially.
//!
//! # Activation memory
//!
//! A rank stores a forward's output from the forward until its backward. Forward and backward
//! slots have the same empty positions, so after forward slot `w_r + i` a rank holds the real
//! slots among forward slots `i ..= w_r + i`: the peak is the number of real slots in the
//! busiest window of `w_r + 1` consecutive slots ([`Schedule::activation_bound`]). That is `m`
//! for GPipe, `min(pp − r, m)` for 1F1B and `min(w_r + 1, m·v) = min(v·pp − r, m·v)` for
//! interleaved when `pp | m`.
//!
//! # Bubble
//!
//! With forward and backward costs `t_f`, `t_b` per stage and free communication, GPipe and 1F1B
//! idle `(pp − 1)/(m + pp − 1)` of the time, interleaved `(pp − 1)/(v·m + pp − 1)` when
//! `pp | m` ([`theoretical_bubble`]); the checker's timed simulation reproduces both exactly.
//! When `pp ∤ m` the padded interleaved schedule idles more than that, but never more than 1F1B.

use std::fmt;
use std::str::FromStr;

/// Which pipeline schedule to generate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ScheduleKind {
    /// All forwards, then all backwards. Stores every micro-batch's activations (`m` per rank).
    GPipe,
    /// One-forward-one-backward: a short warm-up, then alternating forward and backward. Same
    /// bubble as GPipe, but rank `r` stores at most `min(pp − r, m)` activations.
    OneFOneB,
    /// Interleaved 1F1B over `v` model chunks per rank: bubble `(pp−1)/(v·m+pp−1)` at the cost of
    /// `v` times more point-to-point messages.
    Interleaved,
}

impl ScheduleKind {
    /// Every kind, in the order they are documented.
    pub const ALL: [ScheduleKind; 3] = [Self::GPipe, Self::OneFOneB, Self::Interleaved];

    /// The name used in configs and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Self::GPipe => "gpipe",
            Self::OneFOneB => "1f1b",
            Self::Interleaved => "interleaved",
        }
    }
}

impl fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ScheduleKind {
    type Err = ScheduleError;

    /// Parses `gpipe`, `1f1b` or `interleaved` (ASCII case is ignored).
    fn from_str(value: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|kind| kind.name().eq_ignore_ascii_case(value.trim()))
            .ok_or_else(|| ScheduleError::UnknownKind {
                value: value.to_string(),
            })
    }
}

/// Why a schedule cannot be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    /// [`ScheduleKind::from_str`] got a name it does not know.
    #[error("unknown pipeline schedule {value:?}; expected one of gpipe, 1f1b, interleaved")]
    UnknownKind { value: String },
    #[error(
        "pipeline schedule needs at least 1 of each: got pp = {pp} stages, \
         v = {v} virtual stages, m = {m} micro-batches"
    )]
    /// `pp`, `v` or `m` is zero.
    Zero { pp: usize, v: usize, m: usize },
    #[error(
        "the {kind} schedule runs one model chunk per rank, but v = {v} virtual stages were \
         requested (pp = {pp}, m = {m}); use the interleaved schedule or v = 1"
    )]
    /// GPipe or 1F1B with more than one chunk per rank.
    VirtualStagesNeedInterleaved {
        kind: ScheduleKind,
        pp: usize,
        v: usize,
        m: usize,
    },
}

/// One step of a rank's schedule. `chunk` is the local chunk index on the rank doing the action
/// (global stage `chunk·pp + rank`); `to`/`from` are pipeline ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// Run the forward of micro-batch `mb` through local chunk `chunk`, keeping its activations.
    Forward { mb: usize, chunk: usize },
    /// Run the backward of micro-batch `mb` through local chunk `chunk`, freeing its activations.
    Backward { mb: usize, chunk: usize },
    /// Send the output of `Forward { mb, chunk }` to rank `to` (next stage).
    SendActivation { mb: usize, chunk: usize, to: usize },
    /// Receive the input of `Forward { mb, chunk }` from rank `from` (previous stage).
    RecvActivation {
        mb: usize,
        chunk: usize,
        from: usize,
    },
    /// Send the input gradient produced by `Backward { mb, chunk }` to rank `to` (previous stage).
    SendGradient { mb: usize, chunk: usize, to: usize },
    /// Receive the output gradient `Backward { mb, chunk }` needs from rank `from` (next stage).
    RecvGradient {
        mb: usize,
        chunk: usize,
        from: usize,
    },
}

impl Action {
    /// The micro-batch this action works on.
    pub fn mb(&self) -> usize {
        match *self {
            Self::Forward { mb, .. }
            | Self::Backward { mb, .. }
            | Self::SendActivation { mb, .. }
            | Self::RecvActivation { mb, .. }
            | Self::SendGradient { mb, .. }
            | Self::RecvGradient { mb, .. } => mb,
        }
    }

    /// The local chunk this action belongs to.
    pub fn chunk(&self) -> usize {
        match *self {
            Self::Forward { chunk, .. }
            | Self::Backward { chunk, .. }
            | Self::SendActivation { chunk, .. }
            | Self::RecvActivation { chunk, .. }
            | Self::SendGradient { chunk, .. }
            | Self::RecvGradient { chunk, .. } => chunk,
        }
    }

    /// The other rank of a send or receive; `None` for compute.
    pub fn peer(&self) -> Option<usize> {
        match *self {
            Self::Forward { .. } | Self::Backward { .. } => None,
            Self::SendActivation { to, .. } | Self::SendGradient { to, .. } => Some(to),
            Self::RecvActivation { from, .. } | Self::RecvGradient { from, .. } => Some(from),
        }
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (mb, chunk) = (self.mb(), self.chunk());
        match *self {
            Self::Forward { .. } => write!(f, "forward mb {mb} chunk {chunk}"),
            Self::Backward { .. } => write!(f, "backward mb {mb} chunk {chunk}"),
            Self::SendActivation { to, .. } => {
                write!(f, "send activation mb {mb} chunk {chunk} to rank {to}")
            }
            Self::RecvActivation { from, .. } => {
                write!(f, "recv activation mb {mb} chunk {chunk} from rank {from}")
            }
            Self::SendGradient { to, .. } => {
                write!(f, "send gradient mb {mb} chunk {chunk} to rank {to}")
            }
            Self::RecvGradient { from, .. } => {
                write!(f, "recv gradient mb {mb} chunk {chunk} from rank {from}")
            }
        }
    }
}

/// Per-rank action lists for one optimiser step. Build with [`Schedule::build`]; verify with
/// [`crate::pp::check::check`] before running it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    /// Which generator produced (or, for a hand-made schedule, which bound applies to) the lists.
    pub kind: ScheduleKind,
    /// Pipeline ranks `pp`.
    pub stages: usize,
    /// Model chunks per rank `v`.
    pub virtual_stages: usize,
    /// Micro-batches per step `m`.
    pub microbatches: usize,
    /// `actions[r]` is rank `r`'s program, run in order.
    pub actions: Vec<Vec<Action>>,
}

impl Schedule {
    /// Generates the schedule of `kind` for `pp` ranks, `v` chunks per rank and `m` micro-batches.
    /// Every `pp, v, m ≥ 1` is supported (interleaved included, any `m`); GPipe and 1F1B need
    /// `v = 1`.
    pub fn build(kind: ScheduleKind, pp: usize, v: usize, m: usize) -> Result<Self, ScheduleError> {
        Self::validate(kind, pp, v, m)?;
        let mut schedule = Self {
            kind,
            stages: pp,
            virtual_stages: v,
            microbatches: m,
            actions: Vec::with_capacity(pp),
        };
        schedule.actions = (0..pp).map(|rank| schedule.rank_actions(rank)).collect();
        Ok(schedule)
    }

    /// Checks the sizes [`Schedule::build`] accepts: `pp, v, m ≥ 1`, and `v = 1` unless `kind`
    /// is interleaved.
    pub fn validate(
        kind: ScheduleKind,
        pp: usize,
        v: usize,
        m: usize,
    ) -> Result<(), ScheduleError> {
        if pp == 0 || v == 0 || m == 0 {
            return Err(ScheduleError::Zero { pp, v, m });
        }
        if v > 1 && kind != ScheduleKind::Interleaved {
            return Err(ScheduleError::VirtualStagesNeedInterleaved { kind, pp, v, m });
        }
        Ok(())
    }

    /// Total number of (virtual) stages `S = pp·v`.
    pub fn num_stages(&self) -> usize {
        self.stages * self.virtual_stages
    }

    /// Global stage of local `chunk` on `rank`: `chunk·pp + rank`.
    pub fn stage_of(&self, rank: usize, chunk: usize) -> usize {
        chunk * self.stages + rank
    }

    /// The rank holding global `stage`: `stage mod pp`.
    pub fn rank_of(&self, stage: usize) -> usize {
        stage % self.stages
    }

    /// Forward slots rank `rank` runs before its first backward slot (see the module doc):
    /// every slot for GPipe, `(pp − 1 − r) + (v − 1)·pp = v·pp − 1 − r` for 1F1B and
    /// interleaved. `rank < pp`.
    pub fn warmup(&self, rank: usize) -> usize {
        let (pp, v) = (self.stages, self.virtual_stages);
        match self.kind {
            ScheduleKind::GPipe => self.slot_count(),
            ScheduleKind::OneFOneB | ScheduleKind::Interleaved => (pp - 1 - rank) + (v - 1) * pp,
        }
    }

    /// The most forward outputs `rank` may hold at once (forward done, backward not yet): the
    /// number of real slots in the busiest window of `warmup(rank) + 1` consecutive slots.
    /// GPipe: `m`; 1F1B: `min(pp − r, m)`; interleaved with `pp | m`: `min(v·pp − r, m·v)`.
    pub fn activation_bound(&self, rank: usize) -> usize {
        let real: Vec<bool> = self
            .slots(Pass::Forward)
            .iter()
            .map(Option::is_some)
            .collect();
        let window = (self.warmup(rank) + 1).min(real.len());
        real.windows(window)
            .map(|w| w.iter().filter(|&&r| r).count())
            .max()
            .unwrap_or(0)
    }

    /// The most forward outputs `rank`'s action list actually holds at once.
    pub fn peak_in_flight(&self, rank: usize) -> usize {
        let mut live = 0usize;
        let mut peak = 0;
        for action in &self.actions[rank] {
            match action {
                Action::Forward { .. } => live += 1,
                Action::Backward { .. } => live = live.saturating_sub(1),
                _ => {}
            }
            peak = peak.max(live);
        }
        peak
    }

    /// The bubble fraction theory predicts for this schedule, see [`theoretical_bubble`].
    pub fn theoretical_bubble(&self) -> f64 {
        theoretical_bubble(
            self.kind,
            self.stages,
            self.virtual_stages,
            self.microbatches,
        )
    }

    /// Rank `rank`'s compute order expanded with its sends and receives.
    fn rank_actions(&self, rank: usize) -> Vec<Action> {
        let mut actions = Vec::new();
        for (pass, mb, chunk) in self.compute_order(rank) {
            self.push_with_communication(rank, pass, mb, chunk, &mut actions);
        }
        actions
    }

    /// Warm-up forwards, then one forward / one backward, then the remaining backwards, over
    /// the padded slots; empty slots are dropped.
    fn compute_order(&self, rank: usize) -> Vec<(Pass, usize, usize)> {
        let forwards = self.slots(Pass::Forward);
        let backwards = self.slots(Pass::Backward);
        let n = forwards.len();
        let w = self.warmup(rank).min(n);
        let warmup = forwards[..w].iter().map(|f| (Pass::Forward, f));
        let steady = forwards[w..]
            .iter()
            .zip(&backwards)
            .flat_map(|(f, b)| [(Pass::Forward, f), (Pass::Backward, b)]);
        let cooldown = backwards[n - w..].iter().map(|b| (Pass::Backward, b));
        warmup
            .chain(steady)
            .chain(cooldown)
            .filter_map(|(pass, slot)| slot.map(|(mb, chunk)| (pass, mb, chunk)))
            .collect()
    }

    /// Slots per rank and pass: `ceil(m / pp)·pp·v`.
    fn slot_count(&self) -> usize {
        self.microbatches.div_ceil(self.stages) * self.stages * self.virtual_stages
    }

    /// The (micro-batch, chunk) pair in each slot of `pass`, `None` for padding. Slot
    /// `g·pp·v + i·pp + j` holds micro-batch `g·pp + j` (if `< m`) and chunk `i` for forwards,
    /// `v − 1 − i` for backwards.
    fn slots(&self, pass: Pass) -> Vec<Option<(usize, usize)>> {
        let (pp, v, m) = (self.stages, self.virtual_stages, self.microbatches);
        (0..self.slot_count())
            .map(|slot| {
                let (group, i, j) = (slot / (pp * v), slot / pp % v, slot % pp);
                let chunk = match pass {
                    Pass::Forward => i,
                    Pass::Backward => v - 1 - i,
                };
                let mb = group * pp + j;
                (mb < m).then_some((mb, chunk))
            })
            .collect()
    }

    /// Appends one compute action with the receive it waits for and the send it feeds.
    fn push_with_communication(
        &self,
        rank: usize,
        pass: Pass,
        mb: usize,
        chunk: usize,
        out: &mut Vec<Action>,
    ) {
        let stage = self.stage_of(rank, chunk);
        let prev = stage.checked_sub(1).map(|s| self.rank_of(s));
        let next = (stage + 1 < self.num_stages()).then(|| self.rank_of(stage + 1));
        // Only neighbours on another rank need messages (with pp = 1 everything is local).
        let remote = |peer: Option<usize>| peer.filter(|&p| p != rank);
        match pass {
            Pass::Forward => {
                if let Some(from) = remote(prev) {
                    out.push(Action::RecvActivation { mb, chunk, from });
                }
                out.push(Action::Forward { mb, chunk });
                if let Some(to) = remote(next) {
                    out.push(Action::SendActivation { mb, chunk, to });
                }
            }
            Pass::Backward => {
                if let Some(from) = remote(next) {
                    out.push(Action::RecvGradient { mb, chunk, from });
                }
                out.push(Action::Backward { mb, chunk });
                if let Some(to) = remote(prev) {
                    out.push(Action::SendGradient { mb, chunk, to });
                }
            }
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pass {
    Forward,
    Backward,
}

/// The idle fraction of an ideal pipeline (equal stages, free communication, any forward and
/// backward costs): `(pp − 1)/(m + pp − 1)` for GPipe and 1F1B, `(pp − 1)/(v·m + pp − 1)` for
/// interleaved (each of the `pp − 1` fill/drain steps is a chunk, `1/v` of a rank's work per
/// micro-batch). `v` is ignored by GPipe and 1F1B; `pp ≤ 1` gives 0.
pub fn theoretical_bubble(kind: ScheduleKind, pp: usize, v: usize, m: usize) -> f64 {
    if pp <= 1 {
        return 0.0;
    }
    let slots = match kind {
        ScheduleKind::GPipe | ScheduleKind::OneFOneB => m,
        ScheduleKind::Interleaved => v * m,
    };
    (pp - 1) as f64 / (slots + pp - 1) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn computes(schedule: &Schedule, rank: usize) -> Vec<String> {
        schedule.actions[rank]
            .iter()
            .filter(|a| a.peer().is_none())
            .map(|a| match a {
                Action::Forward { mb, chunk } => format!("F{mb}.{chunk}"),
                _ => format!("B{}.{}", a.mb(), a.chunk()),
            })
            .collect()
    }

    #[test]
    fn kind_names_round_trip() {
        for kind in ScheduleKind::ALL {
            assert_eq!(kind.to_string().parse::<ScheduleKind>(), Ok(kind));
        }
        assert_eq!("1F1B".parse::<ScheduleKind>(), Ok(ScheduleKind::OneFOneB));
        let err = "zero-bubble"
            .parse::<ScheduleKind>()
            .unwrap_err()
            .to_string();
        assert!(err.contains("\"zero-bubble\""), "{err}");
        assert!(err.contains("gpipe, 1f1b, interleaved"), "{err}");
    }

    #[test]
    fn invalid_sizes_name_every_number() {
        let err = Schedule::build(ScheduleKind::OneFOneB, 4, 0, 8).unwrap_err();
        assert_eq!(err, ScheduleError::Zero { pp: 4, v: 0, m: 8 });
        let msg = err.to_string();
        assert!(msg.contains("pp = 4") && msg.contains("v = 0") && msg.contains("m = 8"));

        for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
            let msg = Schedule::build(kind, 4, 2, 8).unwrap_err().to_string();
            assert!(msg.contains(kind.name()), "{msg}");
            assert!(msg.contains("v = 2") && msg.contains("pp = 4") && msg.contains("m = 8"));
        }
    }

    #[test]
    fn action_display() {
        let recv = Action::RecvActivation {
            mb: 3,
            chunk: 0,
            from: 1,
        };
        assert_eq!(recv.to_string(), "recv activation mb 3 chunk 0 from rank 1");
        let fwd = Action::Forward { mb: 3, chunk: 1 };
        assert_eq!(fwd.to_string(), "forward mb 3 chunk 1");
    }

    #[test]
    fn gpipe_and_1f1b_orders() {
        let gpipe = Schedule::build(ScheduleKind::GPipe, 3, 1, 3).unwrap();
        assert_eq!(
            computes(&gpipe, 1),
            ["F0.0", "F1.0", "F2.0", "B0.0", "B1.0", "B2.0"]
        );

        let ofob = Schedule::build(ScheduleKind::OneFOneB, 3, 1, 4).unwrap();
        let rank0 = [
            "F0.0", "F1.0", "F2.0", "B0.0", "F3.0", "B1.0", "B2.0", "B3.0",
        ];
        assert_eq!(computes(&ofob, 0), rank0);
        let rank2 = [
            "F0.0", "B0.0", "F1.0", "B1.0", "F2.0", "B2.0", "F3.0", "B3.0",
        ];
        assert_eq!(computes(&ofob, 2), rank2);
        assert_eq!(
            ofob.actions[1][..3],
            [
                Action::RecvActivation {
                    mb: 0,
                    chunk: 0,
                    from: 0
                },
                Action::Forward { mb: 0, chunk: 0 },
                Action::SendActivation {
                    mb: 0,
                    chunk: 0,
                    to: 2
                },
            ]
        );
    }

    #[test]
    fn interleaved_groups_and_padded_last_group() {
        // pp = 2, v = 2, m = 3: groups {0, 1} and {2, (3)}, where micro-batch 3 is padding.
        let s = Schedule::build(ScheduleKind::Interleaved, 2, 2, 3).unwrap();
        assert_eq!((s.warmup(0), s.warmup(1)), (3, 2));
        let rank0 = [
            "F0.0", "F1.0", "F0.1", "F1.1", "B0.1", "F2.0", "B1.1", "B0.0", "F2.1", "B1.0", "B2.1",
            "B2.0",
        ];
        assert_eq!(computes(&s, 0), rank0);
        let rank1 = [
            "F0.0", "F1.0", "F0.1", "B0.1", "F1.1", "B1.1", "F2.0", "B0.0", "B1.0", "F2.1", "B2.1",
            "B2.0",
        ];
        assert_eq!(computes(&s, 1), rank1);
        assert_eq!((s.activation_bound(0), s.activation_bound(1)), (4, 3));
        assert_eq!((s.peak_in_flight(0), s.peak_in_flight(1)), (4, 3));
    }

    #[test]
    fn interleaved_with_one_chunk_is_1f1b() {
        for (pp, m) in [(1, 1), (3, 2), (4, 9)] {
            let a = Schedule::build(ScheduleKind::Interleaved, pp, 1, m).unwrap();
            let b = Schedule::build(ScheduleKind::OneFOneB, pp, 1, m).unwrap();
            assert_eq!(a.actions, b.actions);
        }
    }

    #[test]
    fn single_rank_has_no_communication() {
        let s = Schedule::build(ScheduleKind::Interleaved, 1, 3, 2).unwrap();
        assert!(s.actions[0].iter().all(|a| a.peer().is_none()));
        assert_eq!(s.actions[0].len(), 2 * 3 * 2);
    }

    #[test]
    fn bounds_match_the_documented_formulas() {
        for pp in 1..=8 {
            for m in 1..=32 {
                let gpipe = Schedule::build(ScheduleKind::GPipe, pp, 1, m).unwrap();
                let ofob = Schedule::build(ScheduleKind::OneFOneB, pp, 1, m).unwrap();
                for rank in 0..pp {
                    assert_eq!(gpipe.activation_bound(rank), m);
                    assert_eq!(ofob.activation_bound(rank), (pp - rank).min(m));
                    assert!(ofob.peak_in_flight(rank) <= gpipe.peak_in_flight(rank));
                }
                for v in 1..=4 {
                    let inter = Schedule::build(ScheduleKind::Interleaved, pp, v, m).unwrap();
                    for rank in 0..pp {
                        assert_eq!(inter.activation_bound(rank), inter.peak_in_flight(rank));
                        if m % pp == 0 {
                            let bound = (v * pp - rank).min(m * v);
                            assert_eq!(inter.activation_bound(rank), bound);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn theoretical_bubbles() {
        assert_eq!(theoretical_bubble(ScheduleKind::GPipe, 4, 1, 8), 3.0 / 11.0);
        assert_eq!(
            theoretical_bubble(ScheduleKind::OneFOneB, 4, 7, 8),
            3.0 / 11.0
        );
        assert_eq!(
            theoretical_bubble(ScheduleKind::Interleaved, 4, 2, 8),
            3.0 / 19.0
        );
        assert_eq!(theoretical_bubble(ScheduleKind::Interleaved, 1, 2, 8), 0.0);
    }
}
