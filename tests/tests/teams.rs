//! The team runtime through its Rust API: hooks that change what an agent receives or
//! refuse its turn, against the scripted server over HTTP and the real local executor.

use std::sync::{Arc, Mutex};

use futures::future::BoxFuture;
use tandem_agent::team::{Agent, AgentReply, Ended, Hook, Team, Turn, check};
use tandem_agent::{ChatModel, ModelConfig, SessionSlot};
use tandem_executor::{CancellationToken, Executor, Limits, SessionSpec};
use tandem_executor_local::{LocalConfig, LocalExecutor};
use tandem_protocol::team::{AgentSpec, Kind, TeamSpec, Termination};
use tandem_protocol::{ErrorInfo, EventMsg, Message};
use tandem_tests::{Reply, ScriptedOpenAi};

/// A scripted server whose `coder` agent of `task` says `replies`, and a model on it.
async fn coder(task: &str, replies: Vec<Reply>) -> (ScriptedOpenAi, ChatModel) {
    let server = ScriptedOpenAi::start([(format!("{task}#coder"), replies)].into_iter().collect())
        .await
        .unwrap();
    let model = ChatModel::new(ModelConfig {
        base_url: server.base_url(),
        max_retries: 0,
        ..ModelConfig::default()
    })
    .unwrap();
    (server, model)
}

/// `spec`, checked, with `model` for every assistant and the local executor for every
/// executor; at most 10 turns.
fn local_team(spec: &TeamSpec, model: &ChatModel) -> Team {
    let executor: Arc<dyn Executor> = Arc::new(LocalExecutor::new(LocalConfig::default()));
    Team::new(
        check(spec).unwrap(),
        model.clone(),
        |_| Ok(model.clone()),
        |_| Ok(SessionSlot::new(executor.clone(), SessionSpec::default())),
        10,
        &Limits::default(),
    )
    .unwrap()
}

/// Refuses code that mentions `forbidden`, and adds a note to every assistant's view.
struct Gate;

impl Hook for Gate {
    fn before_reply(
        &self,
        _path: &str,
        kind: Kind,
        messages: &mut Vec<Message>,
    ) -> Result<(), String> {
        match kind {
            Kind::Executor if messages.iter().any(|m| m.content.contains("forbidden")) => {
                Err("the gate refused code that touches forbidden things".to_owned())
            }
            Kind::Assistant => {
                messages.push(Message::new(
                    tandem_protocol::Role::User,
                    "note from the gate",
                ));
                Ok(())
            }
            _ => Ok(()),
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_hook_changes_what_an_agent_receives_and_can_refuse_a_turn() {
    let task = "team api: gate";
    let (server, model) = coder(
        task,
        vec![
            Reply::from("```python\nprint('forbidden')\n```"),
            Reply::from("```python\nprint('allowed')\n```"),
        ],
    )
    .await;
    let spec = TeamSpec {
        team: AgentSpec {
            kind: Kind::Chat,
            agents: Some(vec!["coder".into(), "runner".into()]),
            termination: Some(Termination {
                max_turns: Some(4),
                ..Termination::default()
            }),
            ..AgentSpec::default()
        },
        agents: [
            (
                "coder".to_owned(),
                AgentSpec {
                    instructions: Some("coder".into()),
                    ..AgentSpec::default()
                },
            ),
            (
                "runner".to_owned(),
                AgentSpec {
                    kind: Kind::Executor,
                    ..AgentSpec::default()
                },
            ),
        ]
        .into_iter()
        .collect(),
    };
    let team = local_team(&spec, &model).with_hook(Arc::new(Gate));
    let events = Arc::new(Mutex::new(Vec::new()));
    let sink = events.clone();
    let tandem_agent::team::Run { ended, history, .. } = team
        .run(
            task,
            Arc::new(move |e| sink.lock().unwrap().push(e)),
            CancellationToken::new(),
            Vec::new(),
        )
        .await;
    team.close().await;
    assert!(ended.is_ok(), "{ended:?}");
    let said: Vec<(&str, &str)> = history
        .iter()
        .map(|s| (s.speaker.as_str(), s.text.as_str()))
        .collect();
    assert_eq!(
        said[2],
        (
            "runner",
            "Not run: the gate refused code that touches forbidden things"
        )
    );
    assert_eq!(said[3].0, "coder");
    assert!(said[4].1.contains("allowed"), "{said:?}");
    // The refused code never ran: one block ran in all, the allowed one.
    let blocks = events
        .lock()
        .unwrap()
        .iter()
        .filter(|e| matches!(e, EventMsg::CodeBlock { .. }))
        .count();
    assert_eq!(blocks, 1);
    // The coder's views carried the gate's note.
    let coder = server.requests_for(task);
    assert!(
        coder
            .iter()
            .all(|r| r.last_message() == Some("note from the gate"))
    );
}

/// A reviewer written in Rust: approves when the last program output it saw printed 42.
struct Reviewer {
    seen: Mutex<Vec<Message>>,
}

impl Agent for Reviewer {
    fn reply<'a>(
        &'a self,
        messages: &'a [Message],
        turn: Turn<'a>,
    ) -> BoxFuture<'a, Result<Option<AgentReply>, ErrorInfo>> {
        Box::pin(async move {
            assert!(turn.number > 0 && !turn.cancel.is_cancelled());
            *self.seen.lock().unwrap() = messages.to_vec();
            let output = messages.last().map_or("", |m| m.content.as_str());
            let text = if output.contains("42") {
                "The program printed 42. APPROVED"
            } else {
                "Not yet."
            };
            Ok(Some(AgentReply {
                text: text.to_owned(),
                usage: None,
                calls: Vec::new(),
            }))
        })
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_agent_written_in_rust_takes_an_assistants_place() {
    let task = "team api: rust agent";
    let (server, model) = coder(task, vec![Reply::from("```python\nprint(6 * 7)\n```")]).await;
    let member = |kind: Kind, instructions: Option<&str>| AgentSpec {
        kind,
        instructions: instructions.map(str::to_owned),
        ..AgentSpec::default()
    };
    let spec = TeamSpec {
        team: AgentSpec {
            kind: Kind::Chat,
            agents: Some(vec!["coder".into(), "runner".into(), "reviewer".into()]),
            termination: Some(Termination {
                any: Some(vec![
                    Termination {
                        mention: Some("APPROVED".into()),
                        agents: Some(vec!["reviewer".into()]),
                        ..Termination::default()
                    },
                    Termination {
                        max_turns: Some(6),
                        ..Termination::default()
                    },
                ]),
                ..Termination::default()
            }),
            ..AgentSpec::default()
        },
        agents: [
            ("coder", member(Kind::Assistant, Some("coder"))),
            ("runner", member(Kind::Executor, None)),
            ("reviewer", member(Kind::Assistant, Some("reviewer"))),
        ]
        .into_iter()
        .map(|(n, a)| (n.to_owned(), a))
        .collect(),
    };
    let make = || local_team(&spec, &model);
    let reviewer = Arc::new(Reviewer {
        seen: Mutex::new(Vec::new()),
    });
    let team = make()
        .with_agent("team/reviewer", reviewer.clone())
        .unwrap();
    let tandem_agent::team::Run { ended, history, .. } = team
        .run(task, Arc::new(|_| {}), CancellationToken::new(), Vec::new())
        .await;
    team.close().await;
    let ended = ended.unwrap();
    assert!(
        matches!(&ended, Ended::Finished { by, .. } if by == "mention APPROVED by reviewer"),
        "{ended:?}"
    );
    let speakers: Vec<&str> = history.iter().map(|s| s.speaker.as_str()).collect();
    assert_eq!(speakers, ["user", "coder", "runner", "reviewer"]);
    // It saw what a model in its place would: its instructions, the task, the others by name.
    let seen = reviewer.seen.lock().unwrap().clone();
    let names: Vec<Option<&str>> = seen.iter().map(|m| m.name.as_deref()).collect();
    assert_eq!(names, [None, None, Some("coder"), Some("runner")]);
    assert_eq!(seen[0].content, "reviewer");
    // Only the coder asked the model server.
    assert_eq!(server.requests_for(task).len(), 1);
    // A path with no assistant is refused.
    let err = make()
        .with_agent("team/runner", reviewer.clone())
        .unwrap_err();
    assert_eq!(
        err.message,
        "team/runner: no assistant of this team is there"
    );
}
