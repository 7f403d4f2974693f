//! The engine on a real model: the 0.5B Qwen2.5-Coder that `tandem model pull
//! qwen2.5-coder-0.5b` fetches, found in `TANDEM_MODELS_DIR` or the cache. Without it these
//! tests fail and say how to get it: they are never skipped.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use tandem_model_embedded::{Embedded, EmbeddedConfig, Event, Finish, Generate};

fn model_path() -> PathBuf {
    let dir = std::env::var_os("TANDEM_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").expect("HOME")).join(".cache/tandem/models")
        });
    let path = dir.join("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
    assert!(
        path.is_file(),
        "the test model is not at {}: run `cargo run -p tandem-cli -- model pull qwen2.5-coder-0.5b` (scripts/fetch-test-model.sh)",
        path.display()
    );
    path
}

fn config() -> EmbeddedConfig {
    EmbeddedConfig {
        context_tokens: 2048,
        cache_tokens: 4096,
        ..EmbeddedConfig::for_cores(2)
    }
}

/// One engine for the tests that do not need their own.
fn shared() -> Arc<Embedded> {
    static ENGINE: OnceLock<Arc<Embedded>> = OnceLock::new();
    ENGINE
        .get_or_init(|| Embedded::load(&model_path(), config()).unwrap())
        .clone()
}

fn chat(user: &str) -> Vec<serde_json::Value> {
    vec![
        serde_json::json!({"role": "system", "content": "You are a terse assistant."}),
        serde_json::json!({"role": "user", "content": user}),
    ]
}

fn request(user: &str) -> Generate {
    Generate {
        messages: chat(user),
        tools: Vec::new(),
        grammar: None,
        max_tokens: 40,
        temperature: 0.0,
        seed: 1,
        stop: vec![],
    }
}

/// How a reply ended, if it ended with `Done`.
fn finish(event: &Event) -> Option<Finish> {
    match event {
        Event::Done { finish, .. } => Some(*finish),
        _ => None,
    }
}

/// The reply's text and its `Done` event.
async fn collect(engine: &Embedded, request: Generate) -> (String, Event) {
    let mut reply = engine.generate(request).unwrap();
    let mut text = String::new();
    while let Some(event) = reply.events.recv().await {
        match event {
            Event::Text(t) => text.push_str(&t),
            done => return (text, done),
        }
    }
    panic!("the reply ended without Done");
}

#[tokio::test]
async fn the_template_from_the_gguf_renders_chatml_ending_at_the_reply() {
    let prompt = shared().render(&chat("hi"), &[]).unwrap();
    assert_eq!(
        prompt,
        "<|im_start|>system\nYou are a terse assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    );
}

fn execute_code() -> serde_json::Value {
    serde_json::json!({"type": "function", "function": {
        "name": "execute_code",
        "description": "Run code and get its output.",
        "parameters": {
            "type": "object",
            "properties": {
                "language": {"type": "string", "enum": ["python", "sh"]},
                "code": {"type": "string"}
            },
            "required": ["language", "code"],
            "additionalProperties": false
        }
    }})
}

#[tokio::test]
async fn the_gguf_template_renders_tools_calls_and_their_answers() {
    let mut messages = chat("Print 5.");
    messages.push(serde_json::json!({"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "execute_code", "arguments": {"language": "python", "code": "print(5)"}}}
    ]}));
    messages.push(serde_json::json!({"role": "tool", "tool_call_id": "c1", "content": "5"}));
    let prompt = shared().render(&messages, &[execute_code()]).unwrap();
    // Qwen's own template: the tools in the system message, the call as the model writes it,
    // and the answer as a tool response.
    assert!(
        prompt.starts_with("<|im_start|>system\nYou are a terse assistant.\n\n# Tools\n"),
        "{prompt}"
    );
    assert!(prompt.contains("\"name\": \"execute_code\""), "{prompt}");
    assert!(
        prompt.contains("<tool_call>\n{\"name\": \"execute_code\", \"arguments\": {\"code\": \"print(5)\", \"language\": \"python\"}}\n</tool_call>"),
        "{prompt}"
    );
    assert!(
        prompt.contains("<tool_response>\n5\n</tool_response>"),
        "{prompt}"
    );
    assert!(prompt.ends_with("<|im_start|>assistant\n"), "{prompt}");
}

#[tokio::test]
async fn asked_with_the_tool_required_the_model_writes_a_call_that_parses() {
    let engine = shared();
    let tools = [execute_code()];
    let grammar = tandem_model_embedded::tool_grammar(&tools).unwrap();
    let (text, done) = collect(
        &engine,
        Generate {
            tools: tools.to_vec(),
            grammar: Some((grammar, true)),
            max_tokens: 200,
            ..request("Print the sum of 2 and 3.")
        },
    )
    .await;
    assert_eq!(finish(&done), Some(Finish::Stop), "{done:?}: {text}");
    let calls = tandem_agent::tools::calls::calls_in_text(&text, &|_| true);
    assert_eq!(calls.len(), 1, "{text}");
    assert_eq!(calls[0].name, "execute_code");
    let args: serde_json::Value = serde_json::from_str(&calls[0].arguments).unwrap();
    assert!(
        ["python", "sh"].contains(&args["language"].as_str().unwrap()),
        "{text}"
    );
    assert!(args["code"].is_string(), "{text}");
}

#[tokio::test]
async fn max_tokens_and_stop_strings_end_the_reply() {
    let engine = shared();
    let (text, done) = collect(
        &engine,
        Generate {
            max_tokens: 5,
            ..request("Count from 1 to 50, separated by spaces.")
        },
    )
    .await;
    assert!(
        matches!(
            done,
            Event::Done {
                finish: Finish::Length,
                completion_tokens: 5,
                ..
            }
        ),
        "{done:?}"
    );
    assert!(!text.is_empty());
    let (text, done) = collect(
        &engine,
        Generate {
            stop: vec!["5".into()],
            ..request("Count from 1 to 50, separated by spaces.")
        },
    )
    .await;
    assert_eq!(finish(&done), Some(Finish::Stop), "{done:?}");
    assert!(text.contains('4') && !text.contains('5'), "{text:?}");
}

#[tokio::test]
async fn a_fixed_seed_gives_the_same_reply_and_the_cache_does_not_change_it() {
    let sampled = |seed| Generate {
        temperature: 0.9,
        seed,
        max_tokens: 24,
        ..request("Write a one-line Python hello world.")
    };
    let fresh = Embedded::load(&model_path(), config()).unwrap();
    let (first, _) = collect(&fresh, sampled(7)).await;
    // Again on the same engine: the prompt now comes from its cache.
    let (again, done) = collect(&fresh, sampled(7)).await;
    assert_eq!(first, again);
    assert!(
        matches!(done, Event::Done { cached_tokens, prompt_tokens, .. } if cached_tokens + 1 == prompt_tokens),
        "{done:?}"
    );
    let other = Embedded::load(&model_path(), config()).unwrap();
    let (elsewhere, _) = collect(&other, sampled(7)).await;
    assert_eq!(first, elsewhere);
}

#[tokio::test]
async fn a_dropped_reply_stops_and_the_next_request_is_served() {
    let engine = Embedded::load(&model_path(), config()).unwrap();
    let mut reply = engine
        .generate(Generate {
            max_tokens: 500,
            ..request("Write a long story.")
        })
        .unwrap();
    assert!(matches!(reply.events.recv().await, Some(Event::Text(_))));
    drop(reply);
    let (text, done) = collect(&engine, request("Say OK.")).await;
    assert_eq!(finish(&done), Some(Finish::Stop), "{done:?}");
    assert!(!text.is_empty());
    // The cancelled reply's sequence was freed, not kept: only the second conversation is.
    let stats = engine.stats();
    assert_eq!(
        (stats.sequences_live, stats.sequences_kept),
        (0, 1),
        "{stats:?}"
    );
}

#[tokio::test]
async fn a_conversation_over_the_window_is_refused_with_what_to_do() {
    let engine = shared();
    let (_, done) = collect(&engine, request(&"word ".repeat(3000))).await;
    match done {
        Event::Failed(why) => assert!(
            why.contains("over the model's context window of 2048")
                && why.contains("context_tokens"),
            "{why}"
        ),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_missing_file_says_how_to_get_one() {
    let e = Embedded::load(std::path::Path::new("/nonexistent/m.gguf"), config()).unwrap_err();
    assert_eq!(
        e.to_string(),
        "no model file at /nonexistent/m.gguf; `tandem model pull` downloads one"
    );
}

/// Requests sent at once; their texts and `Done` events in the order sent.
async fn together(engine: &Embedded, requests: Vec<Generate>) -> Vec<(String, Event)> {
    let replies: Vec<_> = requests
        .into_iter()
        .map(|r| engine.generate(r).unwrap())
        .collect();
    let mut out = Vec::new();
    for mut reply in replies {
        let mut text = String::new();
        loop {
            match reply
                .events
                .recv()
                .await
                .expect("the reply ended without Done")
            {
                Event::Text(t) => text.push_str(&t),
                done => {
                    out.push((text, done));
                    break;
                }
            }
        }
    }
    out
}

fn counting(from: u32) -> Generate {
    Generate {
        max_tokens: 24,
        ..request(&format!("Count from {from} upwards, separated by spaces."))
    }
}

fn sampled(user: &str, seed: u32) -> Generate {
    Generate {
        temperature: 0.9,
        seed,
        max_tokens: 24,
        ..request(user)
    }
}

#[tokio::test]
async fn replies_generated_together_are_each_what_it_is_alone() {
    let engine = Embedded::load(&model_path(), config()).unwrap();
    let batch: Vec<_> = (0..4).map(alone_request).collect();
    let mut alone = Vec::new();
    for r in batch.clone() {
        alone.push(collect(&engine, r).await.0);
    }
    // A fresh engine, so nothing of the runs above is in its cache.
    let fresh = Embedded::load(&model_path(), config()).unwrap();
    let at_once = together(&fresh, batch).await;
    for (i, (text, done)) in at_once.iter().enumerate() {
        assert!(finish(done).is_some(), "{done:?}");
        assert_eq!(
            text, &alone[i],
            "request {i} differs when generated beside the others"
        );
    }
    // Requests that arrive while another generates: their prompts are read in chunks beside
    // its tokens.
    let first = Generate {
        max_tokens: 48,
        ..counting(300)
    };
    let (first_alone, _) = collect(&engine, first.clone()).await;
    let mut running = fresh.generate(first).unwrap();
    let mut text = String::new();
    match running.events.recv().await {
        Some(Event::Text(t)) => text.push_str(&t),
        other => panic!("{other:?}"),
    }
    let late = together(&fresh, vec![alone_request(1), alone_request(3)]).await;
    while let Some(event) = running.events.recv().await {
        match event {
            Event::Text(t) => text.push_str(&t),
            done => assert!(finish(&done).is_some(), "{done:?}"),
        }
    }
    assert_eq!(text, first_alone);
    assert_eq!(late[0].0, alone[1]);
    assert_eq!(late[1].0, alone[3]);
    let stats = fresh.stats();
    assert!(stats.steps > 0 && stats.tokens_generated > 0, "{stats:?}");
}

/// The requests of `replies_generated_together_are_each_what_it_is_alone`, by index.
fn alone_request(i: usize) -> Generate {
    [
        counting(1),
        sampled("Write a one-line Python hello world.", 7),
        counting(100),
        Generate {
            max_tokens: 24,
            ..request("Name three prime numbers.")
        },
    ][i]
        .clone()
}

fn turn_two(first: &Generate, reply: &str, user: &str) -> Generate {
    let mut next = first.clone();
    next.messages
        .push(serde_json::json!({"role": "assistant", "content": reply}));
    next.messages
        .push(serde_json::json!({"role": "user", "content": user}));
    next
}

#[tokio::test]
async fn a_second_turn_reads_only_its_new_tokens_while_others_run() {
    let engine = Embedded::load(&model_path(), config()).unwrap();
    let first = Generate {
        max_tokens: 24,
        ..request("Write a Python function that reverses a string.")
    };
    let (reply, done) = collect(&engine, first.clone()).await;
    let Event::Done {
        prompt_tokens: first_prompt,
        completion_tokens,
        ..
    } = done
    else {
        panic!("{done:?}");
    };
    // Three other conversations start, then the first one's second turn comes.
    let mut others: Vec<_> = (0..3)
        .map(|i| engine.generate(counting(10 * i + 1)).unwrap())
        .collect();
    for other in &mut others {
        assert!(matches!(other.events.recv().await, Some(Event::Text(_))));
    }
    let (_, done) = collect(&engine, turn_two(&first, &reply, "Now test it.")).await;
    let Event::Done {
        cached_tokens,
        prompt_tokens,
        ..
    } = done
    else {
        panic!("{done:?}");
    };
    // All of turn one and its reply came from the cache (the reply's end tag is new).
    assert!(
        cached_tokens + 2 >= first_prompt + completion_tokens && prompt_tokens > cached_tokens,
        "{cached_tokens} of {prompt_tokens} cached; turn one was {first_prompt} + {completion_tokens}"
    );
    for mut other in others {
        loop {
            match other.events.recv().await.unwrap() {
                Event::Text(_) => {}
                done => {
                    assert!(finish(&done).is_some(), "{done:?}");
                    break;
                }
            }
        }
    }
}

#[tokio::test]
async fn a_shared_system_prompt_is_read_once() {
    let engine = Embedded::load(&model_path(), config()).unwrap();
    let system = "You are a careful assistant who writes Python. ".repeat(20);
    let ask = |user: &str| Generate {
        messages: vec![
            serde_json::json!({"role": "system", "content": system}),
            serde_json::json!({"role": "user", "content": user}),
        ],
        max_tokens: 4,
        ..request("")
    };
    let (_, first) = collect(&engine, ask("Say one.")).await;
    let (_, second) = collect(&engine, ask("Name a colour.")).await;
    let (
        Event::Done {
            prompt_tokens: p1,
            cached_tokens: c1,
            ..
        },
        Event::Done {
            cached_tokens: c2, ..
        },
    ) = (first, second)
    else {
        panic!();
    };
    assert_eq!(c1, 0);
    // The system message and the user header, but not the other question.
    assert!(c2 > 150 && c2 < p1, "{c2} of {p1}");
    // Both conversations are kept.
    assert_eq!(engine.stats().sequences_kept, 2, "{:?}", engine.stats());

    // Arriving together, the shared start is read by the first and borrowed by the others,
    // and each reply is what it is alone.
    let questions = ["Say one.", "Name a colour.", "Name a fruit."];
    let mut alone = Vec::new();
    for q in questions {
        alone.push(collect(&engine, ask(q)).await.0);
    }
    let fresh = Embedded::load(&model_path(), config()).unwrap();
    let at_once = together(&fresh, questions.iter().map(|q| ask(q)).collect()).await;
    for (i, (text, done)) in at_once.iter().enumerate() {
        assert_eq!(text, &alone[i], "request {i}");
        let Event::Done { cached_tokens, .. } = done else {
            panic!("{done:?}");
        };
        if i > 0 {
            assert!(*cached_tokens > 150, "request {i}: {done:?}");
        }
    }
}

#[tokio::test]
async fn a_full_cache_pauses_and_drops_and_every_reply_is_still_right() {
    // Room for one conversation and a little: three at once cannot all be held.
    let small = EmbeddedConfig {
        context_tokens: 200,
        cache_tokens: 240,
        batch_tokens: 64,
        ..config()
    };
    let long = |from| Generate {
        max_tokens: 120,
        ..counting(from)
    };
    let batch: Vec<_> = [1, 200, 5000].into_iter().map(long).collect();
    let roomy = Embedded::load(&model_path(), config()).unwrap();
    let mut alone = Vec::new();
    for r in batch.clone() {
        alone.push(collect(&roomy, r).await.0);
    }
    let engine = Embedded::load(&model_path(), small).unwrap();
    let at_once = together(&engine, batch).await;
    // Read again after a pause, a reply goes on where it was: each still counts on from its
    // number. (Its text may differ from the roomy engine's in a late token: its cells sit
    // elsewhere in the cache, and sums are taken in another order.)
    for (i, (text, done)) in at_once.iter().enumerate() {
        assert!(finish(done).is_some(), "{done:?}");
        let head = |t: &str| t.split_whitespace().take(3).collect::<Vec<_>>().join(" ");
        assert_eq!(head(text), head(&alone[i]), "request {i}: {text:?}");
        assert!(text.split_whitespace().count() > 8, "request {i}: {text:?}");
    }
    let stats = engine.stats();
    assert!(stats.pauses + stats.evictions > 0, "{stats:?}");
    assert!(stats.cache_tokens_used <= 240, "{stats:?}");
}

#[tokio::test]
async fn forty_requests_at_once_are_served_first_come_first_served() {
    let engine = Embedded::load(
        &model_path(),
        EmbeddedConfig {
            parallel: 4,
            ..config()
        },
    )
    .unwrap();
    let n = 40;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    for i in 0..n {
        let mut reply = engine
            .generate(Generate {
                max_tokens: 3,
                ..counting(i * 3 + 1)
            })
            .unwrap();
        let tx = tx.clone();
        tokio::spawn(async move {
            while let Some(event) = reply.events.recv().await {
                if !matches!(event, Event::Text(_)) {
                    let _ = tx.send((i, event));
                    return;
                }
            }
        });
    }
    drop(tx);
    let mut order = Vec::new();
    while let Some((i, done)) = rx.recv().await {
        assert!(finish(&done).is_some(), "request {i}: {done:?}");
        order.push(i);
    }
    assert_eq!(order.len(), n as usize, "{order:?}");
    // None is passed by more than the three others that run beside it.
    for (place, &i) in order.iter().enumerate() {
        assert!(
            place + 4 > i as usize,
            "request {i} finished {place}th: {order:?}"
        );
    }
    assert_eq!(engine.stats().sequences_live, 0);
}

#[tokio::test]
async fn a_draft_changes_nothing_but_how_the_tokens_are_found() {
    // The test model drafts for itself: its greedy guesses are the main model's greedy
    // choices, and under sampling many are refused, so both ways through the check run.
    let drafted = Embedded::load(
        &model_path(),
        EmbeddedConfig {
            draft: Some(model_path()),
            ..config()
        },
    )
    .unwrap();
    let plain = Embedded::load(&model_path(), config()).unwrap();
    let tools = [execute_code()];
    let requests = [
        Generate {
            max_tokens: 48,
            ..counting(7)
        },
        Generate {
            max_tokens: 48,
            ..sampled("Write a Python function that reverses a string.", 3)
        },
        Generate {
            tools: tools.to_vec(),
            grammar: Some((tandem_model_embedded::tool_grammar(&tools).unwrap(), true)),
            max_tokens: 80,
            ..request("Print the sum of 2 and 3.")
        },
    ];
    for (i, r) in requests.into_iter().enumerate() {
        let (without, done) = collect(&plain, r.clone()).await;
        let (with, done_drafted) = collect(&drafted, r).await;
        assert_eq!(with, without, "request {i}");
        assert_eq!(done_drafted, done, "request {i}");
    }
    let stats = drafted.stats();
    assert!(stats.draft, "{stats:?}");
    assert!(
        stats.draft_accepted > 0 && stats.draft_accepted < stats.draft_proposed,
        "{stats:?}"
    );
    assert_eq!(plain.stats().draft_proposed, 0);
    let missing = Embedded::load(
        &model_path(),
        EmbeddedConfig {
            draft: Some("/nonexistent/draft.gguf".into()),
            ..config()
        },
    )
    .unwrap_err();
    assert_eq!(
        missing.to_string(),
        "no model file at /nonexistent/draft.gguf; `tandem model pull` downloads one"
    );
}

/// A grammar of `levels` brackets, each opened by two rules that differ only after it
/// closes: every bracket doubles the stacks the grammar keeps alive, in a grammar that grows
/// by a line a level.
fn doubling_grammar(levels: usize) -> String {
    let mut gbnf = String::from("root ::= l0\n");
    for i in 0..levels {
        gbnf.push_str(&format!(
            "l{i} ::= \"[\" l{n} \"]\" | \"[\" l{n} \"] \"\n",
            n = i + 1
        ));
    }
    gbnf.push_str(&format!("l{levels} ::= \"1\"\n"));
    gbnf
}

#[tokio::test(flavor = "multi_thread")]
async fn a_grammar_whose_stacks_multiply_fails_its_reply_alone_and_the_engine_serves_on() {
    let engine = shared();
    let bomb = Generate {
        grammar: Some((doubling_grammar(40), true)),
        max_tokens: 60,
        // A prompt the model would answer in words: the grammar refuses its choice at each
        // token, and the whole vocabulary goes through every stack.
        ..request("Say hello.")
    };
    let mut bombed = engine.generate(bomb).unwrap();
    // Another client asks meanwhile; it is answered in full.
    let other = tokio::spawn({
        let engine = engine.clone();
        async move { collect(&engine, request("Count to three.")).await }
    });
    let failed = tokio::time::timeout(std::time::Duration::from_secs(300), async {
        loop {
            match bombed.events.recv().await {
                Some(Event::Text(_)) => continue,
                other => return other,
            }
        }
    })
    .await
    .expect("the engine waited on one reply's grammar");
    match failed {
        Some(Event::Failed(why)) => {
            assert!(why.contains("the tool call grammar took"), "{why}")
        }
        other => panic!("the multiplying grammar's reply: {other:?}"),
    }
    let (text, done) = tokio::time::timeout(std::time::Duration::from_secs(300), other)
        .await
        .expect("the other reply waited past the deadline")
        .unwrap();
    assert!(matches!(done, Event::Done { .. }), "{done:?}");
    assert!(!text.is_empty());
}
