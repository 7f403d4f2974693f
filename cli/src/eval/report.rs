//! What `tandem eval` tells: each task's result as it ends, the run's totals, and two runs
//! side by side.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use tandem_protocol::{StopReason, Verdict};

/// How one task of the suite went.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TaskResult {
    /// The suite task's id.
    pub id: String,
    /// What its check decided; `None` when the task was cancelled or never ran.
    pub verdict: Option<Verdict>,
    /// Why the task ended.
    pub stop_reason: Option<StopReason>,
    /// Assistant turns taken.
    pub turns: u32,
    /// Prompt tokens used.
    pub input_tokens: u64,
    /// Completion tokens used.
    pub output_tokens: u64,
    /// Wall time of the task and its check, seconds.
    pub seconds: f64,
    /// Which part did not hold, the check's error, or the task's.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub detail: String,
    /// The suite's split the task is in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub split: Option<String>,
    /// The suite's tags of the task.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tags: Vec<String>,
    /// The task's answer, as it ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answer: Option<String>,
    /// Where the answer came from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answer_from: Option<tandem_protocol::AnswerFrom>,
    /// With a `value` check: whether the task's code printed the value.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub printed: Option<bool>,
}

impl TaskResult {
    /// Whether its check said solved.
    pub fn solved(&self) -> bool {
        self.verdict == Some(Verdict::Solved)
    }

    fn verdict_word(&self) -> &'static str {
        match (self.verdict, self.stop_reason) {
            (Some(v), _) => match v {
                Verdict::Solved => "solved",
                Verdict::Unsolved => "unsolved",
                Verdict::Error => "check error",
            },
            (None, Some(StopReason::Cancelled)) => "cancelled",
            (None, _) => "not run",
        }
    }
}

/// A run's totals.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Totals {
    /// Tasks with a verdict of solved or unsolved (check errors and cancelled tasks aside).
    pub judged: usize,
    /// Tasks solved.
    pub solved: usize,
    /// Tasks whose check failed.
    pub check_errors: usize,
    /// Tasks that did not run to an end.
    pub not_finished: usize,
    /// `solved / judged`.
    pub solve_rate: f64,
    /// Mean turns of a solved task.
    pub turns_per_solved: f64,
    /// Mean seconds of a solved task.
    pub seconds_per_solved: f64,
    /// Mean seconds of any judged task.
    pub seconds_per_task: f64,
    /// Mean input tokens of a solved task.
    pub input_tokens_per_solved: f64,
    /// Mean output tokens of a solved task.
    pub output_tokens_per_solved: f64,
    /// Mean input tokens of any judged task.
    #[serde(default)]
    pub input_tokens_per_task: f64,
    /// Mean output tokens of any judged task.
    #[serde(default)]
    pub output_tokens_per_task: f64,
    /// Tasks whose code printed the checked value but whose answer missed it.
    #[serde(default)]
    pub printed_not_answered: usize,
}

impl Totals {
    /// The totals of `results`.
    pub fn of(results: &[TaskResult]) -> Self {
        let judged: Vec<&TaskResult> = results
            .iter()
            .filter(|r| matches!(r.verdict, Some(Verdict::Solved | Verdict::Unsolved)))
            .collect();
        let solved: Vec<&TaskResult> = judged.iter().copied().filter(|r| r.solved()).collect();
        let mean = |of: &[&TaskResult], f: &dyn Fn(&TaskResult) -> f64| {
            if of.is_empty() {
                0.0
            } else {
                of.iter().map(|r| f(r)).sum::<f64>() / of.len() as f64
            }
        };
        Self {
            judged: judged.len(),
            solved: solved.len(),
            check_errors: results
                .iter()
                .filter(|r| r.verdict == Some(Verdict::Error))
                .count(),
            not_finished: results.iter().filter(|r| r.verdict.is_none()).count(),
            solve_rate: if judged.is_empty() {
                0.0
            } else {
                solved.len() as f64 / judged.len() as f64
            },
            turns_per_solved: mean(&solved, &|r| f64::from(r.turns)),
            seconds_per_solved: mean(&solved, &|r| r.seconds),
            seconds_per_task: mean(&judged, &|r| r.seconds),
            input_tokens_per_solved: mean(&solved, &|r| r.input_tokens as f64),
            output_tokens_per_solved: mean(&solved, &|r| r.output_tokens as f64),
            input_tokens_per_task: mean(&judged, &|r| r.input_tokens as f64),
            output_tokens_per_task: mean(&judged, &|r| r.output_tokens as f64),
            printed_not_answered: judged
                .iter()
                .filter(|r| r.printed == Some(true) && !r.solved())
                .count(),
        }
    }

    /// The totals in one line, as a person reads them.
    pub fn line(&self) -> String {
        let mut line = format!(
            "solved {} of {} ({:.1}%)",
            self.solved,
            self.judged,
            self.solve_rate * 100.0
        );
        if self.check_errors > 0 {
            let s = if self.check_errors == 1 { "" } else { "s" };
            line.push_str(&format!(" · {} check error{s}", self.check_errors));
        }
        if self.not_finished > 0 {
            line.push_str(&format!(" · {} not finished", self.not_finished));
        }
        if self.printed_not_answered > 0 {
            line.push_str(&format!(
                " · {} printed the value but did not answer it",
                self.printed_not_answered
            ));
        }
        line.push_str(&format!(
            " · per solved task: {:.1} turns, {:.1} s, {:.0} in / {:.0} out tokens · {:.1} s per task",
            self.turns_per_solved,
            self.seconds_per_solved,
            self.input_tokens_per_solved,
            self.output_tokens_per_solved,
            self.seconds_per_task
        ));
        line
    }
}

/// The header of the table of results.
pub fn header() -> String {
    format!(
        "{:<28} {:<11} {:>5} {:>15} {:>8}  {}",
        "task", "verdict", "turns", "tokens in/out", "seconds", "stop"
    )
}

/// One task's row of the table, with why it was not solved under it.
pub fn row(r: &TaskResult) -> String {
    let stop = r.stop_reason.map_or("-", |s| s.as_str());
    let mut row = format!(
        "{:<28} {:<11} {:>5} {:>15} {:>8.1}  {stop}",
        r.id,
        r.verdict_word(),
        r.turns,
        format!("{}/{}", r.input_tokens, r.output_tokens),
        r.seconds
    );
    if !r.solved() && !r.detail.is_empty() {
        let detail: String = tandem_protocol::check::gist(&r.detail)
            .chars()
            .take(110)
            .collect();
        row.push_str(&format!("\n{:<28} {detail}", ""));
    }
    row
}

/// One line of `--json` output: a task's result, or the run's totals last.
#[derive(Serialize, Deserialize)]
#[serde(untagged)]
pub enum Line {
    /// A task ended.
    Task(TaskResult),
    /// The run ended (or was interrupted): its totals.
    Totals {
        /// The totals.
        totals: Totals,
    },
}

/// The task results of a run saved with `--json`; totals lines are worked out again.
pub fn read_run(path: &Path) -> Result<Vec<TaskResult>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the eval run {}", path.display()))?;
    let mut results = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str::<Line>(line) {
            Ok(Line::Task(r)) => results.push(r),
            Ok(Line::Totals { .. }) => {}
            Err(e) => anyhow::bail!(
                "{} line {}: not a line of `tandem eval --json` output: {e}",
                path.display(),
                n + 1
            ),
        }
    }
    Ok(results)
}

/// Two runs side by side, task by task, the tasks whose verdict changed marked, and both
/// totals.
pub fn compare(a: &[TaskResult], b: &[TaskResult], names: (&str, &str)) -> String {
    let by_id: HashMap<&str, &TaskResult> = b.iter().map(|r| (r.id.as_str(), r)).collect();
    let cell = |r: Option<&TaskResult>| match r {
        Some(r) => format!("{} {}t {:.0}s", r.verdict_word(), r.turns, r.seconds),
        None => "-".to_owned(),
    };
    let mut out = format!("{:<28} {:<24} {:<24}\n", "task", "A", "B");
    let (mut better, mut worse) = (0, 0);
    let mut ids: Vec<&str> = a.iter().map(|r| r.id.as_str()).collect();
    for r in b {
        if !ids.contains(&r.id.as_str()) {
            ids.push(&r.id);
        }
    }
    let in_a: HashMap<&str, &TaskResult> = a.iter().map(|r| (r.id.as_str(), r)).collect();
    for id in ids {
        let (ra, rb) = (in_a.get(id).copied(), by_id.get(id).copied());
        let (sa, sb) = (
            ra.is_some_and(TaskResult::solved),
            rb.is_some_and(TaskResult::solved),
        );
        let mark = match (sa, sb) {
            (false, true) => {
                better += 1;
                "  + solved in B"
            }
            (true, false) => {
                worse += 1;
                "  - solved in A only"
            }
            _ => "",
        };
        out.push_str(&format!(
            "{id:<28} {:<24} {:<24}{mark}\n",
            cell(ra),
            cell(rb)
        ));
    }
    out.push_str(&format!("A ({}): {}\n", names.0, Totals::of(a).line()));
    out.push_str(&format!("B ({}): {}\n", names.1, Totals::of(b).line()));
    out.push_str(&format!(
        "{better} solved only in B, {worse} solved only in A\n"
    ));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn result(id: &str, verdict: Option<Verdict>, turns: u32, seconds: f64) -> TaskResult {
        TaskResult {
            id: id.to_owned(),
            verdict,
            stop_reason: Some(StopReason::Terminated),
            turns,
            input_tokens: 100,
            output_tokens: 10,
            seconds,
            detail: String::new(),
            split: None,
            tags: Vec::new(),
            answer: None,
            answer_from: None,
            printed: None,
        }
    }

    #[test]
    fn totals_count_check_errors_and_unfinished_tasks_apart() {
        let results = [
            result("a", Some(Verdict::Solved), 1, 10.0),
            result("b", Some(Verdict::Solved), 3, 20.0),
            result("c", Some(Verdict::Unsolved), 5, 30.0),
            result("d", Some(Verdict::Error), 1, 1.0),
            result("e", None, 0, 0.0),
        ];
        let t = Totals::of(&results);
        assert_eq!(
            (t.judged, t.solved, t.check_errors, t.not_finished),
            (3, 2, 1, 1)
        );
        assert!((t.solve_rate - 2.0 / 3.0).abs() < 1e-9);
        assert!((t.turns_per_solved - 2.0).abs() < 1e-9);
        assert!((t.seconds_per_solved - 15.0).abs() < 1e-9);
        assert!((t.seconds_per_task - 20.0).abs() < 1e-9);
    }

    #[test]
    fn a_comparison_marks_what_changed() {
        let a = [
            result("x", Some(Verdict::Solved), 1, 1.0),
            result("y", Some(Verdict::Unsolved), 1, 1.0),
        ];
        let b = [
            result("x", Some(Verdict::Unsolved), 1, 1.0),
            result("y", Some(Verdict::Solved), 1, 1.0),
        ];
        let text = compare(&a, &b, ("a.json", "b.json"));
        assert!(
            text.contains("x") && text.contains("- solved in A only"),
            "{text}"
        );
        assert!(text.contains("+ solved in B"), "{text}");
        assert!(
            text.contains("1 solved only in B, 1 solved only in A"),
            "{text}"
        );
    }
}
