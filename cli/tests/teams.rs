//! Team files through the real binary: the examples check, a bad file names every problem.

use crate::e2e::tandem;

fn example(name: &str) -> String {
    format!(
        "{}/../examples/teams/{name}.toml",
        env!("CARGO_MANIFEST_DIR")
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn the_example_teams_check_and_print_their_tree() {
    let mut trees = String::new();
    for name in ["review", "refine", "nested"] {
        let out = tandem(&["team", "check", &example(name)], &[], None).await;
        assert_eq!(out.code, 0, "{name}: {}", out.stderr);
        trees.push_str(&format!("# {name}\n{}", out.stdout));
    }
    insta::with_settings!({prepend_module_to_snapshot => false}, {
        insta::assert_snapshot!("team_check_examples", trees);
    });
}

#[tokio::test(flavor = "multi_thread")]
async fn a_bad_team_file_names_each_problem_and_exits_2() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("bad.toml");
    std::fs::write(
        &file,
        "[team]\nkind = \"chat\"\nagents = [\"coder\", \"ghost\"]\ninitial = \"nobody\"\n\n[agents.coder]\nkind = \"assistant\"\nescalate = \"STOP\"\nmax_iterations = 3\n\n[agents.lonely]\nkind = \"assistant\"\n",
    )
    .unwrap();
    let path = file.display().to_string();
    let out = tandem(&["team", "check", &path], &[], None).await;
    assert_eq!(out.code, 2);
    assert_eq!(out.stdout, "");
    let stderr = out.stderr.replace(&path, "bad.toml");
    insta::with_settings!({prepend_module_to_snapshot => false}, {
        insta::assert_snapshot!("team_check_bad_file", stderr);
    });
}

#[tokio::test(flavor = "multi_thread")]
async fn every_team_in_the_docs_checks() {
    let doc = std::fs::read_to_string(format!("{}/../docs/teams.md", env!("CARGO_MANIFEST_DIR")))
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let blocks: Vec<_> = tandem_agent::extract_code_blocks(&doc)
        .into_iter()
        .filter(|b| b.language.as_deref() == Some("toml"))
        .collect();
    assert!(blocks.len() >= 4, "{} team examples", blocks.len());
    for (i, block) in blocks.iter().enumerate() {
        let file = dir.path().join(format!("{i}.toml"));
        std::fs::write(&file, &block.code).unwrap();
        let out = tandem(&["team", "check", &file.display().to_string()], &[], None).await;
        assert_eq!(
            out.code, 0,
            "docs/teams.md example {i}:\n{}\n{}",
            block.code, out.stderr
        );
    }
}
