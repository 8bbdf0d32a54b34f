//! The static checker: proves a [`Schedule`] safe to run before any training starts.
//!
//! [`check`] runs, in order, and stops at the first failure:
//!
//! 1. **Shape.** Valid sizes ([`Schedule::validate`]); one list per rank; every micro-batch, chunk and peer is in range, and every
//!    send/receive goes to the rank holding the neighbouring stage (activations `s → s + 1`,
//!    gradients `s + 1 → s`), never to the rank itself.
//! 2. **Matching.** Every send has exactly one receive of the same message (kind, micro-batch,
//!    stage pair) on the destination rank and every receive exactly one send; duplicates fail.
//! 3. **Dependencies on each rank.** A forward of stage `s > 0` comes after the receive of its
//!    input (or, with `pp = 1`, after the local forward of stage `s − 1`); a send activation after
//!    its forward; a backward after its own forward and after the receive of its output gradient
//!    (or the local backward of stage `s + 1`), unless it is the last stage; a send gradient after
//!    its backward; every (micro-batch, chunk) runs exactly one forward and one backward.
//! 4. **No deadlock.** All ranks are simulated together: compute always proceeds, a receive
//!    blocks until the matching send has run. [`check`] assumes *buffered* sends (a send returns
//!    once queued, like wildfire's host transports); [`check_with`] can also assume
//!    *rendezvous* sends (a send and its receive complete together) or *grouped* ones (each run
//!    of consecutive sends and receives on a rank is posted at once, as one NCCL group, and the
//!    rank goes on once every one of them has met its peer's). A stall reports every blocked
//!    rank with the action it waits at, so a cycle is visible. Without buffering, messages
//!    between two ranks carry no tag and are matched in the order they are posted (NCCL's
//!    point-to-point rule), so those semantics also require that each rank receives from a peer
//!    in the order that peer sends to it.
//! 5. **Memory.** The peak number of stored forward outputs on each rank is at most
//!    [`Schedule::activation_bound`].
//!
//! Every failure about an action names the rank, the action's index in that rank's list and the
//! action; a forward that never runs is named by rank, micro-batch and chunk.
//!
//! The same simulation also times the schedule with unit costs (forward 1, backward 2,
//! communication free): with `T` the time the last rank finishes and `busy_r` rank `r`'s compute
//! time, the simulated bubble is `Σ_r (T − busy_r) / (pp·T)`. For GPipe and 1F1B it equals
//! `(pp − 1)/(m + pp − 1)` exactly, for interleaved with `pp | m` `(pp − 1)/(v·m + pp − 1)`.

use std::fmt;

use super::schedule::{Action, Schedule, ScheduleError, ScheduleKind};

/// Simulated cost of one forward of one chunk.
pub const FORWARD_COST: u64 = 1;
/// Simulated cost of one backward of one chunk.
pub const BACKWARD_COST: u64 = 2;

/// What a send does while its receiver is not ready.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendSemantics {
    /// A send returns once the message is queued (wildfire's transport).
    Buffered,
    /// A send waits until the receiver reaches the matching receive.
    Rendezvous,
    /// Each run of consecutive sends and receives on a rank is posted together (NCCL's
    /// `ncclGroupStart`/`ncclGroupEnd` around `ncclSend`/`ncclRecv`); each completes once its
    /// peer has posted the matching one, and the rank goes on once all of them have.
    Grouped,
}

impl SendSemantics {
    /// Whether messages between two ranks are matched by the order they are posted (no tags).
    fn matched_in_order(self) -> bool {
        self != Self::Buffered
    }
}

impl fmt::Display for SendSemantics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Buffered => "buffered",
            Self::Rendezvous => "rendezvous",
            Self::Grouped => "grouped",
        })
    }
}

/// One action of one rank's list, for error messages: "rank 1 action 4 (forward mb 0 chunk 0)".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct At {
    pub rank: usize,
    pub index: usize,
    pub action: Action,
}

impl fmt::Display for At {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "rank {} action {} ({})",
            self.rank, self.index, self.action
        )
    }
}

/// Why a schedule is unsafe to run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CheckError {
    /// The schedule's sizes themselves are invalid (zero, or `v > 1` without interleaving).
    #[error(transparent)]
    Sizes(#[from] ScheduleError),
    /// There is not exactly one action list per rank.
    #[error("schedule has action lists for {found} ranks but pp = {pp}")]
    RankCount { pp: usize, found: usize },
    /// An action is out of range or talks to the wrong rank.
    #[error("{at}: {reason}")]
    Malformed { at: At, reason: String },
    /// A send without its receive, or a receive without its send.
    #[error("{at}: rank {peer} has no matching {expected}")]
    Unmatched {
        at: At,
        peer: usize,
        expected: &'static str,
    },
    /// A receive that, matched in posting order, would get another message its peer sends first.
    #[error(
        "{at}: rank {peer} sends first ({sent_first}), and without buffering messages \
         between two ranks are received in the order they are sent"
    )]
    OutOfOrder {
        at: At,
        peer: usize,
        sent_first: Action,
    },
    /// The same message is sent (or received) twice.
    #[error("{at}: duplicate of action {first_index} on the same rank")]
    Duplicate { at: At, first_index: usize },
    /// An action runs before what it depends on, or runs twice.
    #[error("{at}: {reason}")]
    Dependency { at: At, reason: String },
    /// A (micro-batch, chunk) is never run forward on the rank that holds it.
    #[error("rank {rank} never runs forward mb {mb} chunk {chunk}")]
    NoForward {
        rank: usize,
        mb: usize,
        chunk: usize,
    },
    /// A forward whose backward never runs: its activations would leak.
    #[error("{at}: its backward never runs")]
    NoBackward { at: At },
    /// The simulation stalled: every rank still running waits on another.
    #[error("deadlock with {semantics} sends: {}", describe_waits(.waits))]
    Deadlock {
        semantics: SendSemantics,
        waits: Vec<At>,
    },
    /// A rank stores more activations than its schedule promises.
    #[error(
        "rank {rank} holds up to {peak} activations, over the {kind} schedule's bound of {bound}"
    )]
    ActivationBound {
        rank: usize,
        peak: usize,
        bound: usize,
        kind: ScheduleKind,
    },
}

fn describe_waits(waits: &[At]) -> String {
    let waits: Vec<String> = waits
        .iter()
        .map(|w| format!("rank {} waits at action {} ({})", w.rank, w.index, w.action))
        .collect();
    waits.join("; ")
}

/// What a passing schedule looks like when run.
#[derive(Debug, Clone, PartialEq)]
pub struct CheckReport {
    /// Peak stored forward outputs per rank.
    pub peak_in_flight: Vec<usize>,
    /// Compute time per rank (forward 1, backward 2).
    pub busy: Vec<u64>,
    /// Time each rank spends waiting within the makespan: `makespan − busy`.
    pub idle: Vec<u64>,
    /// When the last rank finishes.
    pub makespan: u64,
}

impl CheckReport {
    /// Fraction of all rank-time spent idle: `Σ idle / (pp · makespan)`.
    pub fn simulated_bubble(&self) -> f64 {
        let total = self.makespan * self.idle.len() as u64;
        if total == 0 {
            return 0.0;
        }
        self.idle.iter().sum::<u64>() as f64 / total as f64
    }
}

/// Checks `schedule` assuming buffered sends; see the module doc for what is checked.
pub fn check(schedule: &Schedule) -> Result<CheckReport, CheckError> {
    check_with(schedule, SendSemantics::Buffered)
}

/// Checks `schedule`, simulating sends with `semantics`.
pub fn check_with(
    schedule: &Schedule,
    semantics: SendSemantics,
) -> Result<CheckReport, CheckError> {
    Schedule::validate(
        schedule.kind,
        schedule.stages,
        schedule.virtual_stages,
        schedule.microbatches,
    )?;
    check_shape(schedule)?;
    check_matching(schedule)?;
    if semantics.matched_in_order() {
        check_send_order(schedule)?;
    }
    for rank in 0..schedule.stages {
        check_dependencies(schedule, rank)?;
    }
    let (busy, finish) = simulate(schedule, semantics)?;
    let peak_in_flight = check_activation_bounds(schedule)?;
    let makespan = finish.iter().copied().max().unwrap_or(0);
    let idle = busy.iter().map(|b| makespan - b).collect();
    Ok(CheckReport {
        peak_in_flight,
        busy,
        idle,
        makespan,
    })
}

/// Which way a message flows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flow {
    Activation,
    Gradient,
}

/// A message's identity: what it carries, for which micro-batch, from which stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Message {
    flow: Flow,
    mb: usize,
    from_stage: usize,
}

impl Message {
    /// A dense index in `0..message_count(schedule)`, so tables are plain vectors.
    fn index(self, schedule: &Schedule) -> usize {
        let flow = match self.flow {
            Flow::Activation => 0,
            Flow::Gradient => 1,
        };
        (self.mb * schedule.num_stages() + self.from_stage) * 2 + flow
    }
}

fn message_count(schedule: &Schedule) -> usize {
    schedule.microbatches * schedule.num_stages() * 2
}

/// How an action takes part in communication.
#[derive(Debug, Clone, Copy)]
enum Role {
    Compute,
    Send(Message),
    Recv(Message),
}

/// The message an action sends or receives. Assumes the shape check passed.
fn role(schedule: &Schedule, rank: usize, action: &Action) -> Role {
    let stage = schedule.stage_of(rank, action.chunk());
    let message = |flow, from_stage| Message {
        flow,
        mb: action.mb(),
        from_stage,
    };
    match action {
        Action::Forward { .. } | Action::Backward { .. } => Role::Compute,
        Action::SendActivation { .. } => Role::Send(message(Flow::Activation, stage)),
        Action::SendGradient { .. } => Role::Send(message(Flow::Gradient, stage)),
        Action::RecvActivation { .. } => Role::Recv(message(Flow::Activation, stage - 1)),
        Action::RecvGradient { .. } => Role::Recv(message(Flow::Gradient, stage + 1)),
    }
}

fn located(schedule: &Schedule) -> impl Iterator<Item = At> + '_ {
    schedule
        .actions
        .iter()
        .enumerate()
        .flat_map(|(rank, list)| {
            list.iter().enumerate().map(move |(index, &action)| At {
                rank,
                index,
                action,
            })
        })
}

fn check_shape(schedule: &Schedule) -> Result<(), CheckError> {
    let pp = schedule.stages;
    if schedule.actions.len() != pp {
        return Err(CheckError::RankCount {
            pp,
            found: schedule.actions.len(),
        });
    }
    located(schedule).try_for_each(|at| {
        shape_problem(schedule, &at)
            .map_or(Ok(()), |reason| Err(CheckError::Malformed { at, reason }))
    })
}

fn shape_problem(schedule: &Schedule, at: &At) -> Option<String> {
    let (pp, v, m) = (
        schedule.stages,
        schedule.virtual_stages,
        schedule.microbatches,
    );
    let action = at.action;
    if action.mb() >= m {
        return Some(format!(
            "micro-batch {} out of range (m = {m})",
            action.mb()
        ));
    }
    if action.chunk() >= v {
        return Some(format!("chunk {} out of range (v = {v})", action.chunk()));
    }
    let peer = action.peer()?;
    let stage = schedule.stage_of(at.rank, action.chunk());
    let neighbour = match action {
        Action::SendActivation { .. } | Action::RecvGradient { .. } => stage + 1,
        _ => stage.wrapping_sub(1),
    };
    if neighbour >= schedule.num_stages() {
        return Some(format!(
            "stage {stage} has no neighbour stage to exchange this with ({} stages)",
            schedule.num_stages()
        ));
    }
    let expected = schedule.rank_of(neighbour);
    if expected == at.rank {
        return Some(format!(
            "stage {neighbour} is on this rank; it is handed over in memory, not sent"
        ));
    }
    if peer != expected {
        return Some(format!(
            "peer rank {peer} should be rank {expected}, which holds stage {neighbour} (pp = {pp})"
        ));
    }
    None
}

fn check_matching(schedule: &Schedule) -> Result<(), CheckError> {
    let mut sends: Vec<Option<At>> = vec![None; message_count(schedule)];
    let mut recvs = sends.clone();
    for at in located(schedule) {
        let (table, message) = match role(schedule, at.rank, &at.action) {
            Role::Compute => continue,
            Role::Send(message) => (&mut sends, message),
            Role::Recv(message) => (&mut recvs, message),
        };
        if let Some(first) = table[message.index(schedule)].replace(at) {
            return Err(CheckError::Duplicate {
                at,
                first_index: first.index,
            });
        }
    }
    for at in located(schedule) {
        let (other, expected) = match role(schedule, at.rank, &at.action) {
            Role::Compute => continue,
            Role::Send(message) => (recvs[message.index(schedule)], "receive"),
            Role::Recv(message) => (sends[message.index(schedule)], "send"),
        };
        if other.is_none() {
            let peer = at.action.peer().unwrap_or(at.rank);
            return Err(CheckError::Unmatched { at, peer, expected });
        }
    }
    Ok(())
}

/// Each rank receives from each peer in the order that peer sends to it: one pass collects, per
/// ordered pair of ranks, the messages in send order and in receive order, then compares them.
fn check_send_order(schedule: &Schedule) -> Result<(), CheckError> {
    let pp = schedule.stages;
    let mut sent = vec![Vec::new(); pp * pp];
    let mut received = vec![Vec::new(); pp * pp];
    for at in located(schedule) {
        let peer = at.action.peer().unwrap_or(at.rank);
        match role(schedule, at.rank, &at.action) {
            Role::Send(message) => sent[at.rank * pp + peer].push((message, at)),
            Role::Recv(message) => received[peer * pp + at.rank].push((message, at)),
            Role::Compute => {}
        }
    }
    for (sent, received) in sent.iter().zip(&received) {
        for ((sent, send), (got, recv)) in sent.iter().zip(received) {
            if sent != got {
                return Err(CheckError::OutOfOrder {
                    at: *recv,
                    peer: send.rank,
                    sent_first: send.action,
                });
            }
        }
    }
    Ok(())
}

/// Where on one rank each (micro-batch, chunk) event happened, indexed `mb·v + chunk`.
struct Seen {
    v: usize,
    forward: Vec<Option<usize>>,
    backward: Vec<Option<usize>>,
    activation_in: Vec<bool>,
    gradient_in: Vec<bool>,
}

impl Seen {
    fn new(schedule: &Schedule) -> Self {
        let n = schedule.microbatches * schedule.virtual_stages;
        Self {
            v: schedule.virtual_stages,
            forward: vec![None; n],
            backward: vec![None; n],
            activation_in: vec![false; n],
            gradient_in: vec![false; n],
        }
    }

    fn cell(&self, mb: usize, chunk: usize) -> usize {
        mb * self.v + chunk
    }
}

fn check_dependencies(schedule: &Schedule, rank: usize) -> Result<(), CheckError> {
    let mut seen = Seen::new(schedule);
    for (index, &action) in schedule.actions[rank].iter().enumerate() {
        let at = At {
            rank,
            index,
            action,
        };
        dependency_problem(schedule, &mut seen, &at)
            .map_or(Ok(()), |reason| Err(CheckError::Dependency { at, reason }))?;
    }
    for mb in 0..schedule.microbatches {
        for chunk in 0..schedule.virtual_stages {
            let cell = seen.cell(mb, chunk);
            match (seen.forward[cell], seen.backward[cell]) {
                (None, _) => return Err(CheckError::NoForward { rank, mb, chunk }),
                (Some(index), None) => {
                    let action = schedule.actions[rank][index];
                    return Err(CheckError::NoBackward {
                        at: At {
                            rank,
                            index,
                            action,
                        },
                    });
                }
                (Some(_), Some(_)) => {}
            }
        }
    }
    Ok(())
}

/// Records `at` in `seen` and says what it runs ahead of, if anything.
fn dependency_problem(schedule: &Schedule, seen: &mut Seen, at: &At) -> Option<String> {
    let (mb, chunk) = (at.action.mb(), at.action.chunk());
    let cell = seen.cell(mb, chunk);
    let stage = schedule.stage_of(at.rank, chunk);
    let last_stage = schedule.num_stages() - 1;
    let local = schedule.stages == 1;
    match at.action {
        Action::RecvActivation { .. } => seen.activation_in[cell] = true,
        Action::RecvGradient { .. } => seen.gradient_in[cell] = true,
        Action::SendActivation { .. } if seen.forward[cell].is_none() => {
            return Some("sends an activation its forward has not produced yet".into());
        }
        Action::SendGradient { .. } if seen.backward[cell].is_none() => {
            return Some("sends a gradient its backward has not produced yet".into());
        }
        Action::SendActivation { .. } | Action::SendGradient { .. } => {}
        Action::Forward { .. } => {
            if let Some(first) = seen.forward[cell] {
                return Some(format!("forward already ran at action {first}"));
            }
            let input_ready = stage == 0
                || if local {
                    seen.forward[seen.cell(mb, chunk - 1)].is_some()
                } else {
                    seen.activation_in[cell]
                };
            if !input_ready {
                return Some(format!(
                    "runs before its input from stage {} arrived",
                    stage - 1
                ));
            }
            seen.forward[cell] = Some(at.index);
        }
        Action::Backward { .. } => {
            if let Some(first) = seen.backward[cell] {
                return Some(format!("backward already ran at action {first}"));
            }
            if seen.forward[cell].is_none() {
                return Some("runs before its forward".into());
            }
            let grad_ready = stage == last_stage
                || if local {
                    seen.backward[seen.cell(mb, chunk + 1)].is_some()
                } else {
                    seen.gradient_in[cell]
                };
            if !grad_ready {
                return Some(format!(
                    "runs before its output gradient from stage {} arrived",
                    stage + 1
                ));
            }
            seen.backward[cell] = Some(at.index);
        }
    }
    None
}

/// Runs all ranks together. Returns per-rank busy time and finish time, or the deadlock.
fn simulate(
    schedule: &Schedule,
    semantics: SendSemantics,
) -> Result<(Vec<u64>, Vec<u64>), CheckError> {
    let mut sim = Simulation::new(schedule, semantics);
    let mut ready: Vec<usize> = (0..schedule.stages).collect();
    while let Some(rank) = ready.pop() {
        while let Step::Ran { wake } = sim.step(rank) {
            ready.extend(wake);
        }
    }
    let waits: Vec<At> = (0..schedule.stages)
        .filter_map(|rank| sim.current(rank))
        .collect();
    if !waits.is_empty() {
        return Err(CheckError::Deadlock { semantics, waits });
    }
    Ok((sim.busy, sim.clock))
}

/// The outcome of trying to run one rank's current action.
#[derive(Debug, Clone)]
enum Step {
    /// The rank is done or waits on a peer.
    Blocked,
    /// The action ran (or a group was posted); the ranks in `wake` may be able to continue too.
    Ran { wake: Vec<usize> },
}

/// The state of all ranks: a program counter and a clock each, and the messages in flight.
struct Simulation<'a> {
    schedule: &'a Schedule,
    semantics: SendSemantics,
    pc: Vec<usize>,
    clock: Vec<u64>,
    busy: Vec<u64>,
    /// When each message's send was posted, indexed by [`Message::index`].
    posted: Vec<Option<u64>>,
    /// When each message's receive was posted (grouped sends only).
    recv_posted: Vec<Option<u64>>,
    /// Per rank, the end of the group it has posted and waits on (grouped sends only).
    group_end: Vec<Option<usize>>,
}

impl<'a> Simulation<'a> {
    fn new(schedule: &'a Schedule, semantics: SendSemantics) -> Self {
        let pp = schedule.stages;
        Self {
            schedule,
            semantics,
            pc: vec![0; pp],
            clock: vec![0; pp],
            busy: vec![0; pp],
            posted: vec![None; message_count(schedule)],
            recv_posted: vec![None; message_count(schedule)],
            group_end: vec![None; pp],
        }
    }

    fn current(&self, rank: usize) -> Option<At> {
        let index = self.pc[rank];
        self.schedule.actions[rank].get(index).map(|&action| At {
            rank,
            index,
            action,
        })
    }

    /// Runs `rank`'s current action if it can.
    fn step(&mut self, rank: usize) -> Step {
        let Some(at) = self.current(rank) else {
            return Step::Blocked;
        };
        match role(self.schedule, rank, &at.action) {
            Role::Compute => {
                let cost = match at.action {
                    Action::Forward { .. } => FORWARD_COST,
                    _ => BACKWARD_COST,
                };
                self.clock[rank] += cost;
                self.busy[rank] += cost;
                self.pc[rank] += 1;
                Step::Ran { wake: Vec::new() }
            }
            Role::Send(_) | Role::Recv(_) if self.semantics == SendSemantics::Grouped => {
                self.grouped(rank)
            }
            Role::Send(message) | Role::Recv(message)
                if self.semantics == SendSemantics::Rendezvous =>
            {
                self.rendezvous(rank, &at, message)
            }
            Role::Send(message) => {
                self.posted[message.index(self.schedule)] = Some(self.clock[rank]);
                self.pc[rank] += 1;
                Step::Ran {
                    wake: at.action.peer().into_iter().collect(),
                }
            }
            Role::Recv(message) => match self.posted[message.index(self.schedule)] {
                Some(sent_at) => {
                    self.clock[rank] = self.clock[rank].max(sent_at);
                    self.pc[rank] += 1;
                    Step::Ran { wake: Vec::new() }
                }
                None => Step::Blocked,
            },
        }
    }

    /// A send and its receive complete together once both ranks have reached them.
    fn rendezvous(&mut self, rank: usize, at: &At, message: Message) -> Step {
        let Some(peer) = at.action.peer() else {
            return Step::Blocked;
        };
        let matches = self.current(peer).is_some_and(|theirs| {
            match role(self.schedule, peer, &theirs.action) {
                Role::Send(m) | Role::Recv(m) => m == message,
                Role::Compute => false,
            }
        });
        if !matches {
            return Step::Blocked;
        }
        let time = self.clock[rank].max(self.clock[peer]);
        for r in [rank, peer] {
            self.clock[r] = time;
            self.pc[r] += 1;
        }
        Step::Ran { wake: vec![peer] }
    }

    /// The sends and receives of `rank`'s current group, as (message, is a send) in list order.
    fn group(&self, rank: usize, end: usize) -> impl Iterator<Item = (Message, bool)> + '_ {
        self.schedule.actions[rank][self.pc[rank]..end]
            .iter()
            .filter_map(move |action| match role(self.schedule, rank, action) {
                Role::Send(message) => Some((message, true)),
                Role::Recv(message) => Some((message, false)),
                Role::Compute => None,
            })
    }

    /// Posts `rank`'s group (the run of sends and receives from its current action) and wakes
    /// the peers; once posted, completes it when every message has both ends posted.
    fn grouped(&mut self, rank: usize) -> Step {
        let Some(end) = self.group_end[rank] else {
            let list = &self.schedule.actions[rank];
            let start = self.pc[rank];
            let end = (start..list.len())
                .find(|&i| matches!(role(self.schedule, rank, &list[i]), Role::Compute))
                .unwrap_or(list.len());
            let now = self.clock[rank];
            let messages: Vec<(Message, bool)> = self.group(rank, end).collect();
            for (message, is_send) in messages {
                let table = if is_send {
                    &mut self.posted
                } else {
                    &mut self.recv_posted
                };
                table[message.index(self.schedule)] = Some(now);
            }
            self.group_end[rank] = Some(end);
            let wake = list[start..end].iter().filter_map(Action::peer).collect();
            return Step::Ran { wake };
        };
        let mut done = self.clock[rank];
        for (message, _) in self.group(rank, end) {
            let index = message.index(self.schedule);
            match (self.posted[index], self.recv_posted[index]) {
                (Some(sent), Some(received)) => done = done.max(sent).max(received),
                _ => return Step::Blocked,
            }
        }
        self.clock[rank] = done;
        self.pc[rank] = end;
        self.group_end[rank] = None;
        Step::Ran { wake: Vec::new() }
    }
}

fn check_activation_bounds(schedule: &Schedule) -> Result<Vec<usize>, CheckError> {
    (0..schedule.stages)
        .map(|rank| {
            let peak = schedule.peak_in_flight(rank);
            let bound = schedule.activation_bound(rank);
            if peak > bound {
                return Err(CheckError::ActivationBound {
                    rank,
                    peak,
                    bound,
                    kind: schedule.kind,
                });
            }
            Ok(peak)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn build(kind: ScheduleKind, pp: usize, v: usize, m: usize) -> Schedule {
        Schedule::build(kind, pp, v, m).unwrap()
    }

    /// Every (kind, pp, v, m) with pp in 1..=8, m in 1..=max_m and v in 1..=4 (v > 1 only for
    /// interleaved).
    fn sweep(max_m: usize) -> Vec<(ScheduleKind, usize, usize, usize)> {
        let mut cases = Vec::new();
        for pp in 1..=8 {
            for m in 1..=max_m {
                cases.push((ScheduleKind::GPipe, pp, 1, m));
                cases.push((ScheduleKind::OneFOneB, pp, 1, m));
                cases.extend((1..=4).map(|v| (ScheduleKind::Interleaved, pp, v, m)));
            }
        }
        cases
    }

    #[test]
    fn sweep_all_schedules_pass() {
        for (kind, pp, v, m) in sweep(32) {
            let schedule = build(kind, pp, v, m);
            let report = check(&schedule)
                .unwrap_or_else(|e| panic!("{kind} pp = {pp} v = {v} m = {m}: {e}"));
            let bounds: Vec<usize> = (0..pp).map(|r| schedule.activation_bound(r)).collect();
            assert_eq!(
                report.peak_in_flight, bounds,
                "{kind} pp = {pp} v = {v} m = {m}"
            );
        }
    }

    #[test]
    fn simulated_bubble_equals_theory_for_gpipe_and_1f1b() {
        for pp in 1..=8 {
            for m in 1..=32 {
                for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
                    let schedule = build(kind, pp, 1, m);
                    let report = check(&schedule).unwrap();
                    let makespan = report.makespan as usize;
                    let idle = report.idle.iter().sum::<u64>() as usize;
                    let unit = (FORWARD_COST + BACKWARD_COST) as usize;
                    assert_eq!(makespan, unit * (m + pp - 1), "{kind} pp {pp} m {m}");
                    // idle / (pp·T) == (pp − 1)/(m + pp − 1), compared exactly as fractions.
                    assert_eq!(idle * (m + pp - 1), (pp - 1) * pp * makespan);
                    assert_eq!(report.simulated_bubble(), schedule.theoretical_bubble());
                }
            }
        }
    }

    #[test]
    fn one_f_one_b_stores_no_more_than_gpipe() {
        for pp in 1..=8 {
            for m in 1..=32 {
                let gpipe = check(&build(ScheduleKind::GPipe, pp, 1, m)).unwrap();
                let ofob = check(&build(ScheduleKind::OneFOneB, pp, 1, m)).unwrap();
                for rank in 0..pp {
                    assert!(ofob.peak_in_flight[rank] <= gpipe.peak_in_flight[rank]);
                    assert_eq!(ofob.peak_in_flight[rank], (pp - rank).min(m));
                    assert_eq!(gpipe.peak_in_flight[rank], m);
                }
            }
        }
    }

    /// Interleaved matches `(pp − 1)/(v·m + pp − 1)` exactly when `pp | m`; with a padded last
    /// group it idles more, but never more than 1F1B.
    #[test]
    fn interleaved_bubble_matches_theory_and_beats_1f1b() {
        for pp in 1..=8 {
            for m in 1..=32 {
                let ofob = check(&build(ScheduleKind::OneFOneB, pp, 1, m)).unwrap();
                for v in 2..=4 {
                    let report = check(&build(ScheduleKind::Interleaved, pp, v, m)).unwrap();
                    let (sim, base) = (report.simulated_bubble(), ofob.simulated_bubble());
                    assert!(sim <= base, "pp {pp} v {v} m {m}: {sim} > 1f1b {base}");
                    if m % pp == 0 {
                        let idle: usize = report.idle.iter().sum::<u64>() as usize;
                        let total = pp * report.makespan as usize;
                        assert_eq!(
                            idle * (v * m + pp - 1),
                            (pp - 1) * total,
                            "pp {pp} v {v} m {m}"
                        );
                    }
                }
            }
        }
    }

    fn message_of(result: Result<CheckReport, CheckError>) -> String {
        result
            .expect_err("the checker must reject this schedule")
            .to_string()
    }

    fn assert_mentions(message: &str, parts: &[&str]) {
        for part in parts {
            assert!(
                message.contains(part),
                "{message:?} should mention {part:?}"
            );
        }
    }

    #[test]
    fn rejects_missing_receive() {
        let mut schedule = build(ScheduleKind::OneFOneB, 2, 1, 2);
        let recv = Action::RecvActivation {
            mb: 1,
            chunk: 0,
            from: 0,
        };
        schedule.actions[1].retain(|a| *a != recv);
        let message = message_of(check(&schedule));
        let send_index = schedule.actions[0]
            .iter()
            .position(|a| {
                *a == Action::SendActivation {
                    mb: 1,
                    chunk: 0,
                    to: 1,
                }
            })
            .unwrap();
        assert_mentions(
            &message,
            &[
                &format!("rank 0 action {send_index}"),
                "(send activation mb 1 chunk 0 to rank 1)",
                "rank 1 has no matching receive",
            ],
        );
    }

    /// Each rank receives before it sends what the other needs: rank 0 waits for a gradient of
    /// micro-batch 0 before sending that micro-batch's activation.
    #[test]
    fn rejects_cycle_as_deadlock_naming_every_waiting_rank() {
        use Action::*;
        let mut schedule = build(ScheduleKind::GPipe, 2, 1, 1);
        schedule.actions = vec![
            vec![
                Forward { mb: 0, chunk: 0 },
                RecvGradient {
                    mb: 0,
                    chunk: 0,
                    from: 1,
                },
                SendActivation {
                    mb: 0,
                    chunk: 0,
                    to: 1,
                },
                Backward { mb: 0, chunk: 0 },
            ],
            vec![
                RecvActivation {
                    mb: 0,
                    chunk: 0,
                    from: 0,
                },
                Forward { mb: 0, chunk: 0 },
                Backward { mb: 0, chunk: 0 },
                SendGradient {
                    mb: 0,
                    chunk: 0,
                    to: 0,
                },
            ],
        ];
        let message = message_of(check(&schedule));
        assert_eq!(
            message,
            "deadlock with buffered sends: \
             rank 0 waits at action 1 (recv gradient mb 0 chunk 0 from rank 1); \
             rank 1 waits at action 0 (recv activation mb 0 chunk 0 from rank 0)"
        );
    }

    #[test]
    fn rejects_backward_before_forward() {
        let mut schedule = build(ScheduleKind::OneFOneB, 3, 1, 2);
        // Rank 2 (last stage) runs F0 B0 F1 B1; swap its first forward and backward.
        let list = &mut schedule.actions[2];
        let f = list
            .iter()
            .position(|a| matches!(a, Action::Forward { .. }))
            .unwrap();
        let b = list
            .iter()
            .position(|a| matches!(a, Action::Backward { .. }))
            .unwrap();
        list.swap(f, b);
        let message = message_of(check(&schedule));
        assert_mentions(
            &message,
            &[
                &format!("rank 2 action {f}"),
                "(backward mb 0 chunk 0)",
                "before its forward",
            ],
        );
    }

    #[test]
    fn rejects_duplicated_send() {
        let mut schedule = build(ScheduleKind::GPipe, 2, 1, 2);
        let send = Action::SendActivation {
            mb: 0,
            chunk: 0,
            to: 1,
        };
        let first = schedule.actions[0].iter().position(|a| *a == send).unwrap();
        schedule.actions[0].insert(first + 1, send);
        let message = message_of(check(&schedule));
        assert_mentions(
            &message,
            &[
                &format!("rank 0 action {}", first + 1),
                "(send activation mb 0 chunk 0 to rank 1)",
                &format!("duplicate of action {first}"),
            ],
        );
    }

    #[test]
    fn rejects_wrong_peer_and_out_of_range() {
        let mut schedule = build(ScheduleKind::OneFOneB, 3, 1, 2);
        schedule.actions[0][1] = Action::SendActivation {
            mb: 0,
            chunk: 0,
            to: 2,
        };
        assert_mentions(
            &message_of(check(&schedule)),
            &["rank 0 action 1", "peer rank 2 should be rank 1"],
        );
        let mut schedule = build(ScheduleKind::OneFOneB, 3, 1, 2);
        schedule.actions[1][1] = Action::Forward { mb: 5, chunk: 0 };
        assert_mentions(
            &message_of(check(&schedule)),
            &[
                "rank 1 action 1 (forward mb 5 chunk 0)",
                "out of range (m = 2)",
            ],
        );
    }

    #[test]
    fn rejects_missing_backward() {
        let mut schedule = build(ScheduleKind::GPipe, 1, 1, 3);
        schedule.actions[0].retain(|a| *a != Action::Backward { mb: 2, chunk: 0 });
        assert_eq!(
            message_of(check(&schedule)),
            "rank 0 action 2 (forward mb 2 chunk 0): its backward never runs"
        );
        let mut schedule = build(ScheduleKind::GPipe, 1, 1, 3);
        schedule.actions[0].retain(|a| a.mb() != 1);
        assert_eq!(
            message_of(check(&schedule)),
            "rank 0 never runs forward mb 1 chunk 0"
        );
    }

    #[test]
    fn rejects_invalid_sizes() {
        let mut schedule = build(ScheduleKind::OneFOneB, 2, 1, 2);
        schedule.virtual_stages = 2;
        let message = message_of(check(&schedule));
        assert_mentions(&message, &["1f1b", "v = 2", "pp = 2", "m = 2"]);
    }

    #[test]
    fn rejects_more_in_flight_than_the_bound() {
        // A GPipe order labelled 1F1B stores m activations on every rank.
        let mut schedule = build(ScheduleKind::GPipe, 2, 1, 4);
        schedule.kind = ScheduleKind::OneFOneB;
        assert_eq!(
            message_of(check(&schedule)),
            "rank 0 holds up to 4 activations, over the 1f1b schedule's bound of 2"
        );
    }

    /// With rendezvous sends, GPipe always passes; 1F1B and interleaved pass only when no two
    /// ranks ever send to each other at once (pp = 1 or m = 1), which is why they rely on
    /// buffered sends (or on batched send/receive in the executor).
    #[test]
    fn rendezvous_passes_exactly_gpipe_single_rank_or_single_microbatch() {
        for (kind, pp, v, m) in sweep(12) {
            let result = check_with(&build(kind, pp, v, m), SendSemantics::Rendezvous);
            let expected = kind == ScheduleKind::GPipe || pp == 1 || m == 1;
            assert_eq!(result.is_ok(), expected, "{kind} pp {pp} v {v} m {m}");
        }
        let err = check_with(
            &build(ScheduleKind::OneFOneB, 2, 1, 2),
            SendSemantics::Rendezvous,
        )
        .unwrap_err()
        .to_string();
        assert_eq!(
            err,
            "deadlock with rendezvous sends: \
             rank 0 waits at action 3 (send activation mb 1 chunk 0 to rank 1); \
             rank 1 waits at action 3 (send gradient mb 0 chunk 0 to rank 0)"
        );
    }

    /// Grouped sends (one NCCL group per run of consecutive sends and receives) pass GPipe and
    /// 1F1B at every size, with the buffered timing: where rendezvous sends deadlock, a stage's
    /// send and its next receive are posted together and meet the peer's pair. Interleaved
    /// schedules are refused at some sizes: between two ranks they send activations and
    /// gradients in an order the receiver does not follow (pp 2 v 2 m 3), or their wrap-around
    /// sends form a ring that grouping does not break (pp 3 v 2 m 4).
    #[test]
    fn grouped_sends_pass_gpipe_and_1f1b_and_refuse_interleaved_by_order() {
        for (kind, pp, v, m) in sweep(12) {
            let schedule = build(kind, pp, v, m);
            let at = format!("{kind} pp {pp} v {v} m {m}");
            match check_with(&schedule, SendSemantics::Grouped) {
                Ok(grouped) => assert_eq!(grouped, check(&schedule).unwrap(), "{at}"),
                Err(CheckError::OutOfOrder { .. } | CheckError::Deadlock { .. })
                    if kind == ScheduleKind::Interleaved => {}
                Err(e) => panic!("{at}: {e}"),
            }
        }
    }

    /// Swapping two receives from the same peer passes with buffered (tagged) sends but not
    /// where messages are matched in the order they are sent.
    #[test]
    fn unbuffered_sends_refuse_receives_out_of_send_order() {
        let mut schedule = build(ScheduleKind::GPipe, 2, 1, 2);
        let recv = |mb| Action::RecvActivation {
            mb,
            chunk: 0,
            from: 0,
        };
        // Both receives first, the later micro-batch's first: every dependency still holds.
        let list = &mut schedule.actions[1];
        list.retain(|a| !matches!(a, Action::RecvActivation { .. }));
        list.splice(0..0, [recv(1), recv(0)]);
        check(&schedule).unwrap();
        for semantics in [SendSemantics::Rendezvous, SendSemantics::Grouped] {
            assert_eq!(
                message_of(check_with(&schedule, semantics)),
                "rank 1 action 0 (recv activation mb 1 chunk 0 from rank 0): rank 0 sends first \
                 (send activation mb 0 chunk 0 to rank 1), and without buffering messages \
                 between two ranks are received in the order they are sent"
            );
        }
    }
}
