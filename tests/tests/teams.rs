//! The team runtime through its Rust API: hooks that change what an agent receives or
//! refuse its turn, against the scripted server over HTTP and the real local executor.

use std::sync::{Arc, Mutex};

use tandem_agent::team::{Hook, Team, check};
use tandem_agent::{ChatModel, ModelConfig, SessionSlot};
use tandem_executor::{CancellationToken, Executor, Limits, SessionSpec};
use tandem_executor_local::{LocalConfig, LocalExecutor};
use tandem_protocol::team::{AgentSpec, Kind, TeamSpec, Termination};
use tandem_protocol::{EventMsg, Message};
use tandem_tests::{Reply, ScriptedOpenAi};

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
    let server = ScriptedOpenAi::start(
        [(
            format!("{task}#coder"),
            vec![
                Reply::from("```python\nprint('forbidden')\n```"),
                Reply::from("```python\nprint('allowed')\n```"),
            ],
        )]
        .into_iter()
        .collect(),
    )
    .await
    .unwrap();
    let model = ChatModel::new(ModelConfig {
        base_url: server.base_url(),
        max_retries: 0,
        ..ModelConfig::default()
    })
    .unwrap();
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
    let executor: Arc<dyn Executor> = Arc::new(LocalExecutor::new(LocalConfig::default()));
    let team = Team::new(
        check(&spec).unwrap(),
        model.clone(),
        |_| Ok(model.clone()),
        |_| Ok(SessionSlot::new(executor.clone(), SessionSpec::default())),
        10,
        &Limits::default(),
    )
    .unwrap()
    .with_hook(Arc::new(Gate));
    let events = Arc::new(Mutex::new(Vec::new()));
    let sink = events.clone();
    let (ended, history, _, _) = team
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
