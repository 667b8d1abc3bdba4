//! Chat data (`{"messages": [...]}` lines) against transformers: under the chat templates
//! of Qwen2.5, Llama 3, Llama 3.1, Mistral and Zephyr (`tests/data/chat`, see its README), every
//! conversation renders to transformers' text and encodes to its ids, the mask counts
//! each assistant turn and its end-of-turn token and nothing else, the templates'
//! refusals are kept; a folder without a template, a template that rewrites earlier
//! turns and malformed lines are refused with the fix; text and conversations mix.

use std::path::{Path, PathBuf};

use serde_json::Value;
use strata_engine::model::chat::{ChatTemplate, Conversation};
use strata_engine::model::data::TokenData;
use strata_engine::model::tokenize::{TextTokenizer, encode_files};

/// `tests/data/<name>`.
fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/data")
        .join(name)
}

fn json(path: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

/// The golden conversations, one `{"messages": ...}` a line, and their lines.
fn chats() -> (Vec<Value>, Vec<String>) {
    let text = std::fs::read_to_string(data("chat/chats.jsonl")).unwrap();
    let lines: Vec<String> = text.lines().map(str::to_string).collect();
    let values = lines
        .iter()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    (values, lines)
}

const TEMPLATES: [&str; 5] = ["qwen2.5", "llama3", "llama3.1", "mistral", "zephyr"];

/// The token file `out` and its mask, read back.
fn tokens_and_mask(out: &Path) -> (Vec<u32>, Vec<bool>) {
    let data = TokenData::open(out).unwrap();
    let ids: Vec<u32> = (0..data.len()).map(|i| data.token(i)).collect();
    let mask: Vec<bool> = std::fs::read(format!("{}.mask", out.display()))
        .unwrap()
        .iter()
        .map(|&b| b == 1)
        .collect();
    assert_eq!(mask.len(), ids.len());
    (ids, mask)
}

/// The error of encoding `lines` (written to `dir/chats.jsonl`) with `tokenizer`.
fn encode_error(tokenizer: &TextTokenizer, dir: &Path, lines: &str) -> String {
    let input = dir.join("chats.jsonl");
    std::fs::write(&input, lines).unwrap();
    let out = dir.join("chats.bin");
    encode_files(tokenizer, &[input], &out, &mut |_, _| {})
        .unwrap_err()
        .to_string()
}

/// The runs of counted tokens of `ids`, decoded.
fn counted_texts(tokenizer: &TextTokenizer, ids: &[u32], mask: &[bool]) -> Vec<String> {
    let mut runs: Vec<Vec<u32>> = Vec::new();
    for (i, (&id, &counted)) in ids.iter().zip(mask).enumerate() {
        if !counted {
            continue;
        }
        match runs.last_mut() {
            Some(run) if i > 0 && mask[i - 1] => run.push(id),
            _ => runs.push(vec![id]),
        }
    }
    runs.iter()
        .map(|run| tokenizer.decode(run).unwrap())
        .collect()
}

/// Each template's golden conversations, rendered and encoded here, give transformers'
/// text and ids; `strata tokenize`'s path (encode_files) writes those ids, and its mask
/// counts exactly each assistant turn's content (trimmed where the template trims it)
/// and the end-of-turn token after it.
#[test]
fn conversations_encode_as_transformers_and_count_assistant_turns_only() {
    let (conversations, lines) = chats();
    let expected = json(&data("chat/expected.json"));
    let dir = tempfile::tempdir().unwrap();
    for name in TEMPLATES {
        let folder = data(&format!("chat/{name}"));
        let golden = &expected["templates"][name];
        let end_of_turn = golden["end_of_turn"].as_str().unwrap();
        let tokenizer = TextTokenizer::open(&folder).unwrap();
        assert_eq!(
            tokenizer.vocab_size() as u64,
            golden["vocab_size"].as_u64().unwrap()
        );
        let template = ChatTemplate::open(&folder).unwrap().unwrap();
        let (mut kept, mut want_ids, mut want_turns) = (String::new(), Vec::new(), Vec::new());
        for (k, want) in golden["conversations"]
            .as_array()
            .unwrap()
            .iter()
            .enumerate()
        {
            let conversation = Conversation::from_json(&conversations[k]["messages"]).unwrap();
            let rendered = template.render_chat(&conversation);
            if let Some(error) = want.get("error") {
                let e = rendered.unwrap_err();
                assert!(e.contains(error.as_str().unwrap()), "{name} {k}: {e}");
                continue;
            }
            let rendered = rendered.unwrap();
            assert_eq!(rendered.text, want["text"].as_str().unwrap(), "{name} {k}");
            let ids: Vec<u32> = serde_json::from_value(want["ids"].clone()).unwrap();
            assert_eq!(
                tokenizer.encode(&rendered.text, false).unwrap(),
                ids,
                "{name} {k}"
            );
            let spans: Vec<&str> = rendered
                .assistant_spans
                .iter()
                .map(|s| &rendered.text[s.clone()])
                .collect();
            assert_eq!(
                spans,
                want["assistant_texts"].as_array().unwrap().clone(),
                "{name} {k}"
            );
            let contents = conversations[k]["messages"].as_array().unwrap().iter();
            for m in contents.filter(|m| m["role"] == "assistant") {
                want_turns.push((m["content"].as_str().unwrap().to_string(), k));
            }
            kept.push_str(&lines[k]);
            kept.push('\n');
            want_ids.extend(ids);
        }
        let input = dir.path().join(format!("{name}.jsonl"));
        std::fs::write(&input, &kept).unwrap();
        let out = dir.path().join(format!("{name}.bin"));
        let summary = encode_files(&tokenizer, &[input], &out, &mut |_, _| {}).unwrap();
        let (ids, mask) = tokens_and_mask(&out);
        assert_eq!(ids, want_ids, "{name}: no EOS added after a conversation");
        assert_eq!(summary.masked, mask.iter().filter(|&&m| !m).count() as u64);
        let turns = counted_texts(&tokenizer, &ids, &mask);
        assert_eq!(turns.len(), want_turns.len(), "{name}: {turns:?}");
        for (turn, (content, k)) in turns.iter().zip(&want_turns) {
            let text = turn
                .strip_suffix(end_of_turn)
                .unwrap_or_else(|| panic!("{name} {k}: {turn:?} does not end with {end_of_turn}"));
            // Llama 3 trims contents; the others write them as they are.
            let want = if name.starts_with("llama") {
                content.trim()
            } else {
                content
            };
            assert_eq!(text, want, "{name} conversation {k}");
        }
    }
}

/// A line of conversation for a model folder without a chat template names the fixes.
#[test]
fn a_folder_without_a_chat_template_is_refused_naming_the_fix() {
    let tokenizer = TextTokenizer::open(&data("tokenizer-bpe")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (_, lines) = chats();
    let text = format!("{{\"text\": \"plain\"}}\n{}\n", lines[0]);
    let e = encode_error(&tokenizer, dir.path(), &text);
    assert!(
        e.contains("chats.jsonl:2:")
            && e.contains("has none")
            && e.contains("`chat_template` to its tokenizer_config.json")
            && e.contains("\"prompt\""),
        "{e}"
    );
}

/// Mistral 7B Instruct v0.3's way with a system prompt (written into the last user
/// turn, tools left out): the conversation's beginnings do not begin its text, so where
/// its assistant turns lie cannot be read off, and it is refused saying so. The file
/// `chat_template.jinja` is taken over tokenizer_config.json's template.
#[test]
fn a_template_that_rewrites_earlier_turns_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(data("chat/mistral").join(file), dir.path().join(file)).unwrap();
    }
    let moving = "{%- if messages[0]['role'] == 'system' %}\n    {%- set system_message = \
                  messages[0]['content'] %}\n    {%- set loop_messages = messages[1:] %}\n{%- \
                  else %}\n    {%- set loop_messages = messages %}\n{%- endif %}\n{{- bos_token \
                  }}\n{%- for message in loop_messages %}\n    {%- if message['role'] == 'user' \
                  %}\n        {%- if loop.last and system_message is defined %}\n            {{- \
                  '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}\n        \
                  {%- else %}\n            {{- '[INST] ' + message['content'] + '[/INST]' }}\n        \
                  {%- endif %}\n    {%- elif message['role'] == 'assistant' %}\n        {{- ' ' + \
                  message['content'] + eos_token }}\n    {%- endif %}\n{%- endfor %}\n";
    std::fs::write(dir.path().join("chat_template.jinja"), moving).unwrap();
    let (conversations, lines) = chats();
    let template = ChatTemplate::open(dir.path()).unwrap().unwrap();
    assert!(template.origin().ends_with("chat_template.jinja"));
    // Without a system prompt it writes each turn in turn: accepted.
    let plain = Conversation::from_json(&conversations[0]["messages"]).unwrap();
    assert_eq!(
        template.render_chat(&plain).unwrap().assistant_spans.len(),
        1
    );
    let tokenizer = TextTokenizer::open(dir.path()).unwrap();
    let e = encode_error(
        &tokenizer,
        dir.path(),
        &format!("{}\n{}\n", lines[0], lines[2]),
    );
    assert!(
        e.contains("chats.jsonl:2:")
            && e.contains("does not begin the whole conversation's text")
            && e.contains("prompt/completion"),
        "{e}"
    );
}

/// Text, prompt/completion and conversation lines in one file: each its own document,
/// as each would be alone.
#[test]
fn text_pairs_and_conversations_mix_in_one_file() {
    let folder = data("chat/qwen2.5");
    let tokenizer = TextTokenizer::open(&folder).unwrap();
    let eos = tokenizer.eos().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("mixed.jsonl");
    let (conversations, lines) = chats();
    let text = r#"{"text": "Plain text counts whole."}"#;
    let pair = r#"{"prompt": "The licence says", "completion": " that you may copy it."}"#;
    std::fs::write(&input, format!("{text}\n{}\n{pair}\n", lines[1])).unwrap();
    let out = dir.path().join("mixed.bin");
    let summary = encode_files(&tokenizer, &[input], &out, &mut |_, _| {}).unwrap();
    assert_eq!(summary.documents, 3);
    let template = ChatTemplate::open(&folder).unwrap().unwrap();
    let chat = template
        .render_chat(&Conversation::from_json(&conversations[1]["messages"]).unwrap())
        .unwrap();
    let mut plain = tokenizer.encode("Plain text counts whole.", true).unwrap();
    plain.push(eos);
    let chat_ids = tokenizer.encode(&chat.text, false).unwrap();
    let prompt = tokenizer.encode("The licence says", true).unwrap();
    let mut completion = tokenizer.encode(" that you may copy it.", false).unwrap();
    completion.push(eos);
    let (ids, mask) = tokens_and_mask(&out);
    assert_eq!(ids, [&plain[..], &chat_ids, &prompt, &completion].concat());
    assert!(mask[..plain.len()].iter().all(|&m| m));
    let after_chat = plain.len() + chat_ids.len();
    assert!(
        mask[after_chat..after_chat + prompt.len()]
            .iter()
            .all(|&m| !m)
    );
    assert!(mask[after_chat + prompt.len()..].iter().all(|&m| m));
    let chat_mask = &mask[plain.len()..after_chat];
    assert_eq!(
        counted_texts(&tokenizer, &chat_ids, chat_mask),
        ["4.<|im_end|>"]
    );
}

/// Malformed conversations are named with their file and line, and what is wrong.
#[test]
fn malformed_conversations_are_named_by_line() {
    let tokenizer = TextTokenizer::open(&data("chat/qwen2.5")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (_, lines) = chats();
    let cases = [
        (r#"{"messages": []}"#, "no message is the assistant's"),
        (r#"{"messages": "hi"}"#, "`messages` is \"hi\", not a list"),
        (
            r#"{"messages": [{"from": "human", "value": "hi"}]}"#,
            "message 0: no `role`",
        ),
        (
            r#"{"messages": [{"role": "gpt", "content": "hi"}]}"#,
            "role \"gpt\" is not one of system, user, assistant",
        ),
        (
            r#"{"messages": [{"role": "user", "content": null}]}"#,
            "message 0: `content` is null, not a string",
        ),
        (
            r#"{"messages": [{"role": "user", "content": "a"}], "text": "b"}"#,
            "not one of `text`",
        ),
    ];
    for (line, why) in cases {
        let e = encode_error(&tokenizer, dir.path(), &format!("{}\n\n{line}\n", lines[0]));
        assert!(
            e.contains("chats.jsonl:3: ") && e.contains(why),
            "{line}: {e}"
        );
    }
}
