//! Chat conversations into text, as Hugging Face transformers renders them: a model
//! folder's chat template (Jinja), the conversations of `{"messages": [...]}` lines, and
//! where each assistant turn lies in the rendered text. Tokenizing the text, and the
//! mask file, are [`super::tokenize`]'s.
//!
//! The template is the one `AutoTokenizer.from_pretrained` picks (transformers 5):
//! `chat_template.jinja` beside `tokenizer.json`, else `tokenizer_config.json`'s
//! `chat_template`, a string or a list of `{name, template}` (the one named "default").
//! It is rendered with what transformers gives it: `messages`, `add_generation_prompt`,
//! `tools` and `documents` (none), the folder's special tokens (`bos_token`,
//! `eos_token`, ... as `tokenizer_config.json` names them, a string or `{"content":
//! ...}`), the functions `raise_exception` and `strftime_now`, its `tojson` (no HTML
//! escaping; `indent`, `separators`, `sort_keys`, `ensure_ascii`), Jinja's loop
//! controls, and blocks trimmed as its environment trims them (`trim_blocks`,
//! `lstrip_blocks`). Python's string and dict methods (`.strip()`, `.split()`,
//! `.items()`, ...) come from minijinja-contrib's pycompat.
//!
//! Assistant turns: turn `i` starts where the rendering of `messages[..i]` with the
//! generation prompt ends, and ends where the rendering of `messages[..=i]` ends, less
//! the whitespace there (the line feed ChatML writes between turns); so it holds the
//! turn's content and the end-of-turn text the template writes after it (`<|im_end|>`,
//! `<|eot_id|>`, `</s>`), which the model must learn to write to stop. Both renderings
//! must be prefixes of the whole conversation's; a template that rewrites earlier turns
//! as later ones come (one that moves the system prompt into the last user turn) is
//! refused by name. [`counted_tokens`] maps the turns onto tokens.
//!
//! Known differences from Jinja2, none of which the templates of Qwen2.5, Llama 3 and
//! 3.1, Mistral or Zephyr use: a printed boolean or none reads `true`/`none` rather than
//! `True`/`None`; objects parsed from JSON keep their keys sorted (so `tojson` of a
//! tool call's arguments lists them sorted, where Python keeps the file's order).

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use minijinja::value::Kwargs;
use minijinja::{Environment, Error, ErrorKind, Value};

use super::ModelError;

/// The special tokens transformers hands every template (`special_tokens_map`).
const SPECIAL_TOKENS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// The roles a message may have.
const ROLES: [&str; 3] = ["system", "user", "assistant"];

/// The name the template is registered under in its environment.
const TEMPLATE_NAME: &str = "chat_template";

/// A model folder's chat template, compiled, with the special tokens it is given.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// The file the template came from.
    origin: PathBuf,
    special_tokens: BTreeMap<&'static str, String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ChatTemplate({})", self.origin.display())
    }
}

/// One conversation of a `messages` line: its messages as the template sees them, and
/// which are the assistant's.
#[derive(Debug, Clone)]
pub struct Conversation {
    messages: Vec<Value>,
    assistant: Vec<bool>,
}

/// A conversation rendered: its text and the byte ranges of its assistant turns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RenderedChat {
    /// The whole conversation as the template writes it.
    pub text: String,
    /// Each assistant turn's content and end-of-turn text, in order.
    pub assistant_spans: Vec<Range<usize>>,
}

/// `dir/name` parsed as JSON, if the file is there.
fn read_json(dir: &Path, name: &str) -> Result<Option<serde_json::Value>, ModelError> {
    let path = dir.join(name);
    let bytes = match std::fs::read(&path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(ModelError::io(&path, e)),
    };
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|e| ModelError::BadInput(format!("{}: not JSON ({e})", path.display())))
}

/// A special token as tokenizer configurations write it: a string or `{"content": ...}`.
fn token_text(value: &serde_json::Value) -> Option<&str> {
    value
        .as_str()
        .or_else(|| value.get("content").and_then(|c| c.as_str()))
}

/// The template source in `config`'s `chat_template` (a string, or a list of
/// `{name, template}` whose "default" is taken), if any.
fn configured_template(
    config: &serde_json::Value,
    path: &Path,
) -> Result<Option<String>, ModelError> {
    let Some(template) = config.get("chat_template").filter(|t| !t.is_null()) else {
        return Ok(None);
    };
    if let Some(source) = template.as_str() {
        return Ok(Some(source.to_string()));
    }
    let named = template.as_array().map(|list| {
        list.iter()
            .filter_map(|t| Some((t.get("name")?.as_str()?, t.get("template")?.as_str()?)))
            .collect::<Vec<_>>()
    });
    let Some(named) = named else {
        return Err(ModelError::BadInput(format!(
            "{}: `chat_template` is {template}, neither a string nor a list of \
             {{\"name\", \"template\"}}",
            path.display()
        )));
    };
    match named.iter().find(|(name, _)| *name == "default") {
        Some((_, source)) => Ok(Some(source.to_string())),
        None => Err(ModelError::BadInput(format!(
            "{}: `chat_template` holds templates named {:?} and none named \"default\", \
             which is the one used; rename the one to use \"default\"",
            path.display(),
            named.iter().map(|(n, _)| *n).collect::<Vec<_>>()
        ))),
    }
}

impl ChatTemplate {
    /// The chat template of the model folder `dir` (see the module's notes for where it is
    /// looked for), or `None` when it has none.
    pub fn open(dir: &Path) -> Result<Option<ChatTemplate>, ModelError> {
        let config_path = dir.join("tokenizer_config.json");
        let config = read_json(dir, "tokenizer_config.json")?.unwrap_or_default();
        let jinja = dir.join("chat_template.jinja");
        let (source, origin) = match std::fs::read_to_string(&jinja) {
            Ok(source) => (source, jinja),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                match configured_template(&config, &config_path)? {
                    Some(source) => (source, config_path),
                    None => return Ok(None),
                }
            }
            Err(e) => return Err(ModelError::io(&jinja, e)),
        };
        let mut special_tokens = BTreeMap::new();
        // transformers reads special_tokens_map.json too, for what the config leaves out.
        let legacy = read_json(dir, "special_tokens_map.json")?.unwrap_or_default();
        for name in SPECIAL_TOKENS {
            let given = [&config, &legacy]
                .into_iter()
                .find_map(|c| token_text(c.get(name)?));
            if let Some(text) = given {
                special_tokens.insert(name, text.to_string());
            }
        }
        ChatTemplate::new(source, origin, special_tokens).map(Some)
    }

    /// The template `source` (from the file `origin`) with `special_tokens`.
    pub fn new(
        source: String,
        origin: PathBuf,
        special_tokens: BTreeMap<&'static str, String>,
    ) -> Result<ChatTemplate, ModelError> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .expect("the default delimiters");
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, source).map_err(|e| {
            ModelError::BadInput(format!(
                "{}: the chat template does not compile: {e}",
                origin.display()
            ))
        })?;
        Ok(ChatTemplate {
            env,
            origin,
            special_tokens,
        })
    }

    /// The file the template came from.
    pub fn origin(&self) -> &Path {
        &self.origin
    }

    /// `messages` rendered, with the prompt that opens an assistant turn after them when
    /// `add_generation_prompt`. The error is the template's, in one line.
    pub fn render(
        &self,
        messages: &[Value],
        add_generation_prompt: bool,
    ) -> Result<String, String> {
        let mut context: BTreeMap<&str, Value> = self
            .special_tokens
            .iter()
            .map(|(name, text)| (*name, Value::from(text.as_str())))
            .collect();
        context.insert("messages", Value::from(messages.to_vec()));
        context.insert("add_generation_prompt", Value::from(add_generation_prompt));
        context.insert("tools", Value::from(()));
        context.insert("documents", Value::from(()));
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .expect("added at construction");
        template.render(Value::from(context)).map_err(|e| {
            let mut text = e.to_string();
            if let Some(detail) = e.detail().filter(|d| !text.contains(d)) {
                text = format!("{text}: {detail}");
            }
            text
        })
    }

    /// `conversation` rendered whole, with its assistant turns' spans (see the module's
    /// notes); an error when the template refuses it, or when it does not render the
    /// conversation's beginnings as prefixes of the whole.
    pub fn render_chat(&self, conversation: &Conversation) -> Result<RenderedChat, String> {
        let messages = &conversation.messages;
        let text = self.render(messages, false)?;
        let prefix_of_text = |i: usize, prompt: bool| -> Result<usize, String> {
            let prefix = self.render(&messages[..i], prompt).map_err(|e| {
                format!("rendering the conversation's first {i} messages failed: {e}")
            })?;
            if !text.starts_with(&prefix) {
                return Err(format!(
                    "the chat template ({}) renders the first {i} messages{} as {prefix:?}, \
                     which does not begin the whole conversation's text; a template that \
                     rewrites earlier turns as later ones come cannot show where each \
                     assistant turn lies: give a template that writes each message in turn, \
                     or the data as prompt/completion pairs",
                    self.origin.display(),
                    if prompt {
                        " and the generation prompt"
                    } else {
                        ""
                    },
                ));
            }
            Ok(prefix.len())
        };
        let mut assistant_spans = Vec::new();
        for (i, _) in conversation
            .assistant
            .iter()
            .enumerate()
            .filter(|(_, a)| **a)
        {
            let start = prefix_of_text(i, true)?;
            let through = prefix_of_text(i + 1, false)?;
            let end = start.max(text[..through].trim_end().len());
            assistant_spans.push(start..end);
        }
        Ok(RenderedChat {
            text,
            assistant_spans,
        })
    }
}

impl Conversation {
    /// The conversation in a line's `messages`: a list of objects, each with a `role`
    /// (system, user or assistant) and a string `content` (other keys go to the
    /// template as they are), at least one of them the assistant's. The error says what
    /// is wrong, for the caller to place.
    pub fn from_json(messages: &serde_json::Value) -> Result<Conversation, String> {
        let list = messages
            .as_array()
            .ok_or_else(|| format!("`messages` is {messages}, not a list"))?;
        let mut conversation = Conversation {
            messages: Vec::with_capacity(list.len()),
            assistant: Vec::with_capacity(list.len()),
        };
        for (k, message) in list.iter().enumerate() {
            let role = message_role(message).map_err(|e| format!("message {k}: {e}"))?;
            conversation.assistant.push(role == "assistant");
            conversation.messages.push(json_value(message));
        }
        if !conversation.assistant.contains(&true) {
            return Err(
                "no message is the assistant's, so nothing in it would count in the \
                        loss"
                    .into(),
            );
        }
        Ok(conversation)
    }

    /// How many messages it holds.
    pub fn len(&self) -> usize {
        self.messages.len()
    }

    /// Whether it holds no message (never, once read).
    pub fn is_empty(&self) -> bool {
        self.messages.is_empty()
    }
}

/// The role of one message, checked with its content.
fn message_role(message: &serde_json::Value) -> Result<&str, String> {
    let object = message
        .as_object()
        .ok_or_else(|| format!("{message} is not an object with a role and a content"))?;
    let role = match object.get("role") {
        Some(serde_json::Value::String(role)) => role.as_str(),
        Some(other) => return Err(format!("`role` is {other}, not a string")),
        None => return Err("no `role`".into()),
    };
    if !ROLES.contains(&role) {
        return Err(format!(
            "role {role:?} is not one of {}; rename the roles (ShareGPT's human and gpt are \
             user and assistant)",
            ROLES.join(", ")
        ));
    }
    match object.get("content") {
        Some(serde_json::Value::String(_)) => Ok(role),
        Some(other) => Err(format!(
            "`content` is {other}, not a string (content given as a list of parts is not \
             read: join its text into one string)"
        )),
        None => Err("no `content`".into()),
    }
}

/// A JSON value as a template value.
fn json_value(value: &serde_json::Value) -> Value {
    match value {
        serde_json::Value::Null => Value::from(()),
        serde_json::Value::Bool(b) => Value::from(*b),
        serde_json::Value::Number(n) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) => Value::from(i),
            (None, Some(u)) => Value::from(u),
            _ => Value::from(n.as_f64().unwrap_or(f64::NAN)),
        },
        serde_json::Value::String(s) => Value::from(s.as_str()),
        serde_json::Value::Array(items) => {
            Value::from(items.iter().map(json_value).collect::<Vec<_>>())
        }
        serde_json::Value::Object(map) => Value::from(
            map.iter()
                .map(|(k, v)| (k.clone(), json_value(v)))
                .collect::<BTreeMap<String, Value>>(),
        ),
    }
}

/// Which tokens lie in `spans`, from the byte `offsets` of each token in the text: a
/// token counts when it overlaps a span (a token that straddles a span's edge counts,
/// as in transformers' assistant masks), or, for a token of no width (an offset
/// trimmed to nothing), when its position lies inside one. Spans are in order.
pub fn counted_tokens(offsets: &[(usize, usize)], spans: &[Range<usize>]) -> Vec<bool> {
    offsets
        .iter()
        .map(|&(start, end)| {
            spans.iter().any(|span| {
                if start == end {
                    span.contains(&start)
                } else {
                    start < span.end && end > span.start
                }
            })
        })
        .collect()
}

/// transformers' `raise_exception(message)`: the template refuses its input.
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// transformers' `tojson`: Python's `json.dumps` with its options, not HTML-escaped.
fn tojson(value: &Value, options: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = options.get("indent")?;
    let separators: Option<Vec<String>> = options.get("separators")?;
    let sort_keys: Option<bool> = options.get("sort_keys")?;
    let ensure_ascii: Option<bool> = options.get("ensure_ascii")?;
    options.assert_all_used()?;
    let (item, key) = match separators.as_deref() {
        Some([item, key]) => (item.clone(), key.clone()),
        Some(_) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be two strings",
            ));
        }
        None if indent.is_some() => (",".into(), ": ".into()),
        None => (", ".into(), ": ".into()),
    };
    let style = JsonStyle {
        indent,
        item,
        key,
        sort_keys: sort_keys.unwrap_or(false),
        ensure_ascii: ensure_ascii.unwrap_or(false),
    };
    let mut out = String::new();
    style.write(value, 0, &mut out)?;
    Ok(Value::from(out))
}

/// How Python's `json.dumps` lays a value out.
struct JsonStyle {
    indent: Option<usize>,
    item: String,
    key: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

impl JsonStyle {
    fn write(&self, value: &Value, depth: usize, out: &mut String) -> Result<(), Error> {
        match value.kind() {
            minijinja::value::ValueKind::Undefined | minijinja::value::ValueKind::None => {
                out.push_str("null")
            }
            minijinja::value::ValueKind::Bool => {
                out.push_str(if value.is_true() { "true" } else { "false" })
            }
            minijinja::value::ValueKind::Number => out.push_str(&python_number(value)),
            minijinja::value::ValueKind::String => {
                self.write_string(value.as_str().unwrap_or(""), out)
            }
            minijinja::value::ValueKind::Map => {
                let mut keys: Vec<Value> = value.try_iter()?.collect();
                if self.sort_keys {
                    keys.sort();
                }
                let items = keys
                    .into_iter()
                    .map(|k| {
                        let v = value.get_item(&k)?;
                        Ok((k, v))
                    })
                    .collect::<Result<Vec<_>, Error>>()?;
                self.write_items(('{', '}'), items.len(), depth, out, |i, out| {
                    self.write_string(&items[i].0.to_string(), out);
                    out.push_str(&self.key);
                    self.write(&items[i].1, depth + 1, out)
                })?;
            }
            _ => {
                let items: Vec<Value> = value.try_iter()?.collect();
                self.write_items(('[', ']'), items.len(), depth, out, |i, out| {
                    self.write(&items[i], depth + 1, out)
                })?;
            }
        }
        Ok(())
    }

    /// `count` items between `brackets`, each written by `item`, laid out by the style.
    fn write_items(
        &self,
        brackets: (char, char),
        count: usize,
        depth: usize,
        out: &mut String,
        mut item: impl FnMut(usize, &mut String) -> Result<(), Error>,
    ) -> Result<(), Error> {
        out.push(brackets.0);
        if count == 0 {
            out.push(brackets.1);
            return Ok(());
        }
        let newline = |out: &mut String, depth: usize| {
            if let Some(indent) = self.indent {
                out.push('\n');
                out.push_str(&" ".repeat(indent * depth));
            }
        };
        for i in 0..count {
            if i > 0 {
                out.push_str(&self.item);
            }
            newline(out, depth + 1);
            item(i, out)?;
        }
        newline(out, depth);
        out.push(brackets.1);
        Ok(())
    }

    fn write_string(&self, text: &str, out: &mut String) {
        out.push('"');
        for c in text.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 || (self.ensure_ascii && !c.is_ascii()) => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        out.push_str(&format!("\\u{unit:04x}"));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

/// A number as Python prints it: integers as they are, floats with a fraction or an
/// exponent (`1.0`, `0.5`, `1e+16`).
fn python_number(value: &Value) -> String {
    if value.is_integer() {
        return value.to_string();
    }
    let x = f64::try_from(value.clone()).unwrap_or(f64::NAN);
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let abs = x.abs();
    if abs != 0.0 && !(1e-4..1e16).contains(&abs) {
        let text = format!("{x:e}");
        let (mantissa, exponent) = text.split_once('e').expect("{:e} writes an exponent");
        let exponent: i32 = exponent.parse().expect("an integer exponent");
        return format!(
            "{mantissa}e{}{:02}",
            if exponent < 0 { '-' } else { '+' },
            exponent.abs()
        );
    }
    format!("{x:?}")
}

/// transformers' `strftime_now(format)`: the time now (UTC here; transformers uses the
/// machine's local time) in `format`, for the strftime codes templates use.
fn strftime_now(format: String) -> Result<Value, Error> {
    let seconds = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    strftime(seconds, &format).map(Value::from)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// `seconds` after 1970-01-01 UTC in `format` (%d %-d %m %Y %y %H %M %S %b %B %a %A
/// %j %%).
fn strftime(seconds: u64, format: &str) -> Result<String, Error> {
    let days = seconds / 86_400;
    let (year, month, day) = civil_from_days(days as i64);
    let day_of_year = days as i64 - days_from_civil(year, 1, 1) + 1;
    let weekday = WEEKDAYS[((days + 3) % 7) as usize]; // 1970-01-01 was a Thursday.
    let month_name = MONTHS[month as usize - 1];
    let clock = seconds % 86_400;
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let code = chars.next().unwrap_or('%');
        let code = if code == '-' {
            match chars.next() {
                Some('d') => {
                    out.push_str(&day.to_string());
                    continue;
                }
                other => other.unwrap_or('-'),
            }
        } else {
            code
        };
        let piece = match code {
            'd' => format!("{day:02}"),
            'm' => format!("{month:02}"),
            'Y' => year.to_string(),
            'y' => format!("{:02}", year % 100),
            'H' => format!("{:02}", clock / 3600),
            'M' => format!("{:02}", clock / 60 % 60),
            'S' => format!("{:02}", clock % 60),
            'b' => month_name[..3].to_string(),
            'B' => month_name.to_string(),
            'a' => weekday[..3].to_string(),
            'A' => weekday.to_string(),
            'j' => format!("{day_of_year:03}"),
            '%' => "%".into(),
            other => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("strftime_now: %{other} is not supported here"),
                ));
            }
        };
        out.push_str(&piece);
    }
    Ok(out)
}

/// The (year, month, day) of `days` after 1970-01-01 (Howard Hinnant's civil calendar).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// The days from 1970-01-01 to `year`-`month`-`day`.
fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let yoe = year - era * 400;
    let mp = i64::from((month + 9) % 12);
    let doy = (153 * mp + 2) / 5 + i64::from(day) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    fn template(source: &str) -> ChatTemplate {
        let tokens = BTreeMap::from([("eos_token", "</s>".to_string())]);
        ChatTemplate::new(source.into(), "test.jinja".into(), tokens).unwrap()
    }

    fn conversation(json: &str) -> Conversation {
        Conversation::from_json(&serde_json::from_str(json).unwrap()).unwrap()
    }

    #[test]
    fn strftime_matches_known_dates() {
        // 2024-07-26 12:34:56 UTC, a Friday, day 208.
        let t = 1_721_997_296;
        assert_eq!(
            strftime(t, "%d %b %Y, %A %-d %B %y %H:%M:%S %j %%").unwrap(),
            "26 Jul 2024, Friday 26 July 24 12:34:56 208 %"
        );
        assert_eq!(strftime(0, "%Y-%m-%d %a").unwrap(), "1970-01-01 Thu");
        // 2000-02-29, a leap day.
        assert_eq!(strftime(951_782_400, "%Y-%m-%d").unwrap(), "2000-02-29");
        assert!(strftime(0, "%Q").is_err());
    }

    #[test]
    fn tojson_writes_as_python_json_dumps() {
        let t = template(
            "{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ x | tojson(separators=(',', ':')) }}|{{ s | tojson }}|{{ s | tojson(ensure_ascii=true) }}",
        );
        let mut x = BTreeMap::new();
        x.insert(
            "b".to_string(),
            Value::from(vec![Value::from(1), Value::from(0.5)]),
        );
        x.insert("a".to_string(), Value::from(()));
        x.insert("c".to_string(), Value::from(Vec::<Value>::new()));
        let ctx = BTreeMap::from([("x", Value::from(x)), ("s", Value::from("<é \"q\"\n😀>"))]);
        let env = &t.env;
        let got = env
            .get_template(TEMPLATE_NAME)
            .unwrap()
            .render(Value::from(ctx))
            .unwrap();
        let want = [
            r#"{"a": null, "b": [1, 0.5], "c": []}"#,
            "{\n  \"a\": null,\n  \"b\": [\n    1,\n    0.5\n  ],\n  \"c\": []\n}",
            r#"{"a":null,"b":[1,0.5],"c":[]}"#,
            r#""<é \"q\"\n😀>""#,
            r#""<\u00e9 \"q\"\n\ud83d\ude00>""#,
        ]
        .join("|");
        assert_eq!(got, want);
        assert_eq!(python_number(&Value::from(1.0)), "1.0");
        assert_eq!(python_number(&Value::from(1e16)), "1e+16");
        assert_eq!(python_number(&Value::from(2.5e-5)), "2.5e-05");
    }

    #[test]
    fn spans_cover_assistant_turns_and_end_of_turn_text() {
        let t = template(
            "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% if m.role == 'assistant' %}{{ eos_token }}{% endif %}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}",
        );
        let c = conversation(
            r#"[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "again"}, {"role": "assistant", "content": ""}]"#,
        );
        let r = t.render_chat(&c).unwrap();
        let spans: Vec<&str> = r
            .assistant_spans
            .iter()
            .map(|s| &r.text[s.clone()])
            .collect();
        assert_eq!(spans, ["yo</s>", "</s>"]);
        // A template that writes the system prompt into the last user turn is not
        // prefix-stable: refused, naming why.
        let moving = template(
            "{% for m in messages %}{% if m.role == 'user' and loop.last %}[last]{% endif %}{{ m.content }}{% endfor %}",
        );
        let e = moving.render_chat(&c).unwrap_err();
        assert!(
            e.contains("does not begin the whole conversation's text"),
            "{e}"
        );
    }

    /// Indented block tags on lines of their own vanish whole, as in Jinja2 with
    /// transformers' trim_blocks and lstrip_blocks (Jinja2 3.1.6 gives "a\n    b\nc").
    #[test]
    fn blocks_are_trimmed_as_transformers_trims_them() {
        let t = template("a\n    {% if true %}\n    b\n    {% endif %}\nc");
        assert_eq!(t.render(&[], false).unwrap(), "a\n    b\nc");
    }

    #[test]
    fn tokens_count_where_they_overlap_a_span() {
        let offsets = [(0, 2), (2, 4), (4, 4), (4, 7), (7, 9), (9, 12)];
        assert_eq!(
            counted_tokens(&offsets, &[3..5, 8..9]),
            [false, true, true, true, true, false]
        );
        // An empty span counts nothing, not even a token of no width at its place.
        assert_eq!(counted_tokens(&offsets, &[4..4, 20..30]), [false; 6]);
    }

    #[test]
    fn bad_messages_are_named() {
        let bad =
            |json: &str| Conversation::from_json(&serde_json::from_str(json).unwrap()).unwrap_err();
        assert!(bad(r#"{"role": "user"}"#).contains("not a list"));
        assert!(bad(r#"[{"role": "human", "content": "x"}]"#).contains("role \"human\""));
        assert!(bad(r#"[{"role": 3, "content": "x"}]"#).contains("`role` is 3"));
        assert!(
            bad(r#"[{"role": "user", "content": [{"type": "text"}]}]"#)
                .contains("message 0: `content` is")
        );
        assert!(
            bad(r#"[{"role": "user", "content": "x"}]"#).contains("no message is the assistant's")
        );
        assert!(bad("[]").contains("no message is the assistant's"));
    }
}
