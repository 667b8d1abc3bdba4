//! The built-in corpus of `strata train`: English-like ASCII text made by a small
//! probabilistic grammar, so that the main job trains on data the repository generates
//! rather than downloads.
//!
//! The text has structure a small byte-level model learns in a hundred steps: a
//! vocabulary of a few hundred words drawn with Zipf-like frequencies, spelling rules
//! (plurals, past tenses), capitals after a full stop, agreement (`was`/`were`),
//! recurring phrases, quotations and paragraphs. It is not meant to read well.
//!
//! [`generate`] is deterministic for a seed, on every platform and release: it uses its
//! own random generator (SplitMix64), not one whose stream a crate update could change,
//! and a shorter output is a prefix of a longer one. [`ensure_file`] writes it once, as a
//! `.txt` file, which the token reader takes as raw bytes (one token per byte).
//!
//! This module does not tokenize, batch or download anything.

use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

/// The corpus size the main job uses: 1 MiB, far more than 120 steps of 8 × 64 tokens
/// read, so no batch repeats.
pub const DEFAULT_BYTES: usize = 1 << 20;

/// `bytes` bytes of English-like ASCII text (letters, digits, punctuation, spaces and
/// line feeds), the same for the same `seed`; `generate(n, s)` is a prefix of
/// `generate(m, s)` for `n <= m`.
pub fn generate(bytes: usize, seed: u64) -> Vec<u8> {
    let mut writer = Writer {
        rng: SplitMix64(seed),
        text: String::with_capacity(bytes + 512),
    };
    while writer.text.len() < bytes {
        writer.paragraph();
    }
    let mut text = writer.text.into_bytes();
    text.truncate(bytes);
    debug_assert!(text.is_ascii());
    text
}

/// The path [`ensure_file`] uses: `dir/strata-corpus-<seed>-<bytes>.txt`.
pub fn file_path(dir: &Path, bytes: usize, seed: u64) -> PathBuf {
    dir.join(format!("strata-corpus-{seed}-{bytes}.txt"))
}

/// Writes [`generate`]`(bytes, seed)` to [`file_path`] unless a file of that many bytes is
/// already there, and returns the path. Creates `dir` when missing. The text goes to a
/// temporary name first and is renamed into place, so a reader never sees a partial
/// file and two processes racing write the same bytes.
pub fn ensure_file(dir: &Path, bytes: usize, seed: u64) -> io::Result<PathBuf> {
    let path = file_path(dir, bytes, seed);
    if fs::metadata(&path).is_ok_and(|m| m.is_file() && m.len() == bytes as u64) {
        return Ok(path);
    }
    fs::create_dir_all(dir)?;
    let name = path
        .file_name()
        .expect("file_path ends in a file name")
        .to_string_lossy();
    let temporary = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let written = (|| {
        let mut file = fs::File::create(&temporary)?;
        file.write_all(&generate(bytes, seed))?;
        file.sync_all()?;
        fs::rename(&temporary, &path)
    })();
    if written.is_err() {
        // Best effort: the error that matters is the one returned.
        let _ = fs::remove_file(&temporary);
    }
    written.map(|()| path)
}

/// SplitMix64 (Steele, Lea, Flood 2014): tiny, fast, and fixed forever here. The engine's
/// weight initialisation has its own copy; this one is kept apart on purpose, because a
/// change to it would silently change every corpus file a name already stands for.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0); the modulo bias is far below what matters here.
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// True with probability `percent` / 100.
    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }

    /// An index into a list of `n`, the first entries far likelier than the last
    /// (Zipf-like: the minimum of two uniform draws, twice), as words are in text.
    fn skewed(&mut self, n: usize) -> usize {
        let a = self.below(n).min(self.below(n));
        let b = self.below(n).min(self.below(n));
        a.min(b)
    }

    fn pick<'a>(&mut self, words: &[&'a str]) -> &'a str {
        words[self.skewed(words.len())]
    }
}

struct Writer {
    rng: SplitMix64,
    text: String,
}

impl Writer {
    /// Three to six sentences on one line, then a blank line now and then.
    fn paragraph(&mut self) {
        let sentences = 3 + self.rng.below(4);
        for i in 0..sentences {
            if i > 0 {
                self.text.push(' ');
            }
            let sentence = self.sentence();
            self.text.push_str(&sentence);
        }
        self.text.push('\n');
        if self.rng.chance(30) {
            self.text.push('\n');
        }
    }

    fn sentence(&mut self) -> String {
        let mut s = match self.rng.below(10) {
            0..=2 => self.transitive_clause(),
            3 => self.intransitive_clause(),
            4 => self.counting_clause(),
            5 => self.there_clause(),
            6 => {
                let first = self.transitive_clause();
                let link = self.rng.pick(LINKS);
                let second = self.intransitive_clause();
                format!("{first}, {link} {second}")
            }
            7 => {
                let subject = self.subject();
                let be = if subject.plural { "were" } else { "was" };
                let adjective = self.rng.pick(ADJECTIVES);
                let reason = self.transitive_clause();
                format!("{} {be} {adjective} because {reason}", subject.text)
            }
            8 => return self.quotation(),
            _ => return self.question(),
        };
        s.push('.');
        capitalize(s)
    }

    /// `the old farmer carried a basket to the mill in the morning`
    fn transitive_clause(&mut self) -> String {
        let subject = self.subject().text;
        let (_, past) = TRANSITIVE[self.rng.skewed(TRANSITIVE.len())];
        let object = self.object();
        let mut s = format!("{subject} {past} {object}");
        self.tail(&mut s);
        s
    }

    /// `the dog slept quietly under the table`
    fn intransitive_clause(&mut self) -> String {
        let subject = self.subject().text;
        let (_, past) = INTRANSITIVE[self.rng.skewed(INTRANSITIVE.len())];
        let mut s = format!("{subject} {past}");
        if self.rng.chance(40) {
            s.push(' ');
            s.push_str(self.rng.pick(ADVERBS));
        }
        self.tail(&mut s);
        s
    }

    /// `Anna counted 12 sheep on the hill`
    fn counting_clause(&mut self) -> String {
        let (name, _) = self.name();
        let verb = self.rng.pick(COUNTING_VERBS);
        let count = self.count();
        let noun = plural(self.rng.pick(NOUNS));
        let mut s = format!("{name} {verb} {count} {noun}");
        self.tail(&mut s);
        s
    }

    /// `there were 7 boats near the bridge`
    fn there_clause(&mut self) -> String {
        let noun = self.rng.pick(NOUNS);
        let place = self.place(AT_PREPOSITIONS);
        if self.rng.chance(30) {
            let article = article(noun);
            format!("there was {article} {noun} {place}")
        } else {
            let count = self.count();
            format!("there were {count} {} {place}", plural(noun))
        }
    }

    /// `"Where is the red box?" asked Ben.` or `"The cat slept," said the baker.`
    fn quotation(&mut self) -> String {
        let speaker = if self.rng.chance(60) {
            self.name().0.to_string()
        } else {
            self.subject().text
        };
        if self.rng.chance(40) {
            let noun = self.noun_phrase(false);
            let place = self.place(AT_PREPOSITIONS);
            format!("\"Where is {noun}?\" asked {speaker}. \"It is {place}.\"")
        } else {
            let said = capitalize(self.intransitive_clause());
            let verb = self.rng.pick(SAYING_VERBS);
            format!("\"{said},\" {verb} {speaker}.")
        }
    }

    /// `Did the teacher see the boat? Yes, she did.`
    fn question(&mut self) -> String {
        let subject = self.subject();
        let (base, _) = TRANSITIVE[self.rng.skewed(TRANSITIVE.len())];
        let object = self.object();
        let pronoun = subject.pronoun;
        let answer = if self.rng.chance(50) {
            format!("Yes, {pronoun} did.")
        } else {
            format!("No, {pronoun} did not.")
        };
        format!("Did {} {base} {object}? {answer}", subject.text)
    }

    /// A name and its pronoun.
    fn name(&mut self) -> (&'static str, &'static str) {
        NAMES[self.rng.skewed(NAMES.len())]
    }

    /// Maybe a place, maybe a time, in that order.
    fn tail(&mut self, s: &mut String) {
        if self.rng.chance(50) {
            let prepositions = if self.rng.chance(50) {
                AT_PREPOSITIONS
            } else {
                TO_PREPOSITIONS
            };
            s.push(' ');
            s.push_str(&self.place(prepositions));
        }
        if self.rng.chance(30) {
            s.push(' ');
            s.push_str(self.rng.pick(TIMES));
        }
    }

    fn subject(&mut self) -> Subject {
        match self.rng.below(10) {
            0..=2 => {
                let (name, pronoun) = self.name();
                Subject {
                    text: name.to_string(),
                    plural: false,
                    pronoun,
                }
            }
            3 => Subject {
                text: format!("the {}", self.rng.pick(PLURAL_SUBJECTS)),
                plural: true,
                pronoun: "they",
            },
            _ => {
                let plural = self.rng.chance(20);
                Subject {
                    text: self.noun_phrase(plural),
                    plural,
                    pronoun: if plural { "they" } else { "it" },
                }
            }
        }
    }

    fn object(&mut self) -> String {
        if self.rng.chance(15) {
            let count = self.count();
            return format!("{count} {}", plural(self.rng.pick(NOUNS)));
        }
        let plural_noun = self.rng.chance(15);
        let mut s = self.noun_phrase(plural_noun);
        if self.rng.chance(15) {
            s.push_str(" of ");
            s.push_str(&plural(self.rng.pick(NOUNS)));
        }
        s
    }

    /// `the old farmer`, `a green apple`, `the boats`.
    fn noun_phrase(&mut self, plural_noun: bool) -> String {
        let noun = self.rng.pick(NOUNS);
        let adjective = self.rng.chance(40).then(|| self.rng.pick(ADJECTIVES));
        let noun = if plural_noun {
            plural(noun)
        } else {
            noun.to_string()
        };
        let first = adjective.unwrap_or(&noun);
        let determiner = match (plural_noun, self.rng.below(4)) {
            (_, 0 | 1) => "the",
            (false, 2) => article(first),
            (false, _) => self.rng.pick(DETERMINERS),
            (true, _) => self.rng.pick(PLURAL_DETERMINERS),
        };
        match adjective {
            Some(adjective) => format!("{determiner} {adjective} {noun}"),
            None => format!("{determiner} {noun}"),
        }
    }

    /// `near the old bridge`, with one of `prepositions`.
    fn place(&mut self, prepositions: &[&str]) -> String {
        let preposition = self.rng.pick(prepositions);
        let place = self.rng.pick(PLACES);
        if self.rng.chance(25) {
            format!("{preposition} the {} {place}", self.rng.pick(ADJECTIVES))
        } else {
            format!("{preposition} the {place}")
        }
    }

    /// `two`, `twelve`, `17`, `240`: small counts in words, larger ones in digits.
    fn count(&mut self) -> String {
        if self.rng.chance(60) {
            NUMBER_WORDS[self.rng.skewed(NUMBER_WORDS.len())].to_string()
        } else {
            let n = match self.rng.below(3) {
                0 => 2 + self.rng.below(18),
                1 => 10 * (2 + self.rng.below(9)),
                _ => 100 + self.rng.below(900),
            };
            n.to_string()
        }
    }
}

struct Subject {
    text: String,
    plural: bool,
    /// What stands for it in an answer: `she`, `he`, `it`, `they`.
    pronoun: &'static str,
}

fn capitalize(mut s: String) -> String {
    if let Some(first) = s.get_mut(0..1) {
        first.make_ascii_uppercase();
    }
    s
}

/// `a` or `an` before `word`.
fn article(word: &str) -> &'static str {
    if word.starts_with(['a', 'e', 'i', 'o', 'u']) {
        "an"
    } else {
        "a"
    }
}

/// English plurals: the irregular ones listed, then the regular spelling rules.
fn plural(noun: &str) -> String {
    if let Some((_, p)) = IRREGULAR_PLURALS.iter().find(|(s, _)| *s == noun) {
        return (*p).to_string();
    }
    let consonant_y =
        noun.ends_with('y') && !noun[..noun.len() - 1].ends_with(['a', 'e', 'i', 'o', 'u']);
    if consonant_y {
        format!("{}ies", &noun[..noun.len() - 1])
    } else if noun.ends_with(['s', 'x']) || noun.ends_with("ch") || noun.ends_with("sh") {
        format!("{noun}es")
    } else {
        format!("{noun}s")
    }
}

const IRREGULAR_PLURALS: &[(&str, &str)] = &[
    ("child", "children"),
    ("mouse", "mice"),
    ("sheep", "sheep"),
    ("fish", "fish"),
    ("goose", "geese"),
    ("wolf", "wolves"),
    ("knife", "knives"),
    ("loaf", "loaves"),
    ("leaf", "leaves"),
    ("man", "men"),
    ("woman", "women"),
    ("foot", "feet"),
    ("tooth", "teeth"),
];

const NOUNS: &[&str] = &[
    "cat", "dog", "farmer", "boat", "house", "river", "bird", "child", "baker", "apple", "garden",
    "letter", "book", "horse", "teacher", "box", "key", "tree", "road", "window", "door", "table",
    "lamp", "fox", "sailor", "king", "queen", "bridge", "basket", "cup", "hat", "coat", "ship",
    "train", "clock", "coin", "ring", "song", "story", "map", "rope", "wheel", "hammer", "candle",
    "kettle", "blanket", "shoe", "mouse", "owl", "crow", "frog", "fish", "pig", "cow", "duck",
    "goose", "sheep", "goat", "wolf", "bear", "doctor", "miller", "stone", "cloud", "star",
    "flower", "berry", "cherry", "pony", "puppy", "knife", "loaf", "leaf", "man", "woman", "brush",
    "dish", "bench", "fence", "gate", "chair", "pencil", "bottle", "jar", "bell", "drum", "flute",
    "kite", "ball", "toy", "egg", "cake", "pie", "carrot", "onion", "potato", "tomato", "lemon",
    "melon", "pear", "plum", "nut", "seed", "shell", "feather", "button", "needle", "thread",
    "ladder", "bucket", "shovel", "wagon", "cart", "sled", "tent", "flag", "sword", "shield",
    "crown", "mirror", "pillow", "spoon", "fork", "plate", "bowl", "jug", "barrel",
];

/// Plural subjects that read as groups.
const PLURAL_SUBJECTS: &[&str] = &[
    "children",
    "farmers",
    "sailors",
    "birds",
    "dogs",
    "neighbours",
    "soldiers",
    "twins",
    "students",
    "fishermen",
    "travellers",
    "geese",
    "workers",
    "girls",
    "boys",
];

const ADJECTIVES: &[&str] = &[
    "old", "little", "red", "big", "small", "green", "happy", "young", "quiet", "brown", "tired",
    "clever", "brave", "blue", "white", "black", "yellow", "heavy", "light", "tall", "short",
    "warm", "cold", "wet", "dry", "hungry", "sleepy", "proud", "gentle", "noisy", "shy", "strange",
    "lucky", "wooden", "golden", "silver", "broken", "new", "clean", "dirty", "soft", "hard",
    "sweet", "sour", "round", "square", "bright", "dark", "careful", "busy",
];

/// Transitive verbs: (base, past).
const TRANSITIVE: &[(&str, &str)] = &[
    ("see", "saw"),
    ("find", "found"),
    ("carry", "carried"),
    ("take", "took"),
    ("give", "gave"),
    ("bring", "brought"),
    ("make", "made"),
    ("hold", "held"),
    ("watch", "watched"),
    ("follow", "followed"),
    ("paint", "painted"),
    ("open", "opened"),
    ("close", "closed"),
    ("wash", "washed"),
    ("pull", "pulled"),
    ("push", "pushed"),
    ("help", "helped"),
    ("keep", "kept"),
    ("sell", "sold"),
    ("buy", "bought"),
    ("build", "built"),
    ("fix", "fixed"),
    ("drop", "dropped"),
    ("catch", "caught"),
    ("throw", "threw"),
    ("hide", "hid"),
    ("lose", "lost"),
    ("read", "read"),
    ("write", "wrote"),
    ("draw", "drew"),
    ("fill", "filled"),
    ("lift", "lifted"),
    ("mend", "mended"),
    ("visit", "visited"),
    ("call", "called"),
    ("greet", "greeted"),
    ("chase", "chased"),
    ("feed", "fed"),
    ("cook", "cooked"),
    ("eat", "ate"),
    ("want", "wanted"),
    ("like", "liked"),
    ("forget", "forgot"),
    ("remember", "remembered"),
    ("count", "counted"),
    ("send", "sent"),
    ("ring", "rang"),
    ("cut", "cut"),
    ("tie", "tied"),
    ("row", "rowed"),
];

/// Intransitive verbs: (base, past).
const INTRANSITIVE: &[(&str, &str)] = &[
    ("walk", "walked"),
    ("sleep", "slept"),
    ("sing", "sang"),
    ("wait", "waited"),
    ("run", "ran"),
    ("laugh", "laughed"),
    ("rest", "rested"),
    ("work", "worked"),
    ("play", "played"),
    ("sit", "sat"),
    ("stand", "stood"),
    ("dance", "danced"),
    ("swim", "swam"),
    ("smile", "smiled"),
    ("jump", "jumped"),
    ("hide", "hid"),
    ("listen", "listened"),
    ("whistle", "whistled"),
    ("shout", "shouted"),
    ("cry", "cried"),
    ("fall", "fell"),
    ("climb", "climbed"),
    ("travel", "travelled"),
    ("arrive", "arrived"),
    ("leave", "left"),
];

const COUNTING_VERBS: &[&str] = &[
    "counted", "found", "had", "saw", "bought", "sold", "carried", "wanted", "lost", "kept",
];

const SAYING_VERBS: &[&str] = &["said", "shouted", "whispered", "replied", "answered"];

/// Names with their pronouns.
const NAMES: &[(&str, &str)] = &[
    ("Anna", "she"),
    ("Ben", "he"),
    ("Clara", "she"),
    ("David", "he"),
    ("Emma", "she"),
    ("Felix", "he"),
    ("Grace", "she"),
    ("Henry", "he"),
    ("Ida", "she"),
    ("Jack", "he"),
    ("Kate", "she"),
    ("Leo", "he"),
    ("Mia", "she"),
    ("Noah", "he"),
    ("Olga", "she"),
    ("Paul", "he"),
    ("Rosa", "she"),
    ("Sam", "he"),
    ("Tom", "he"),
    ("Vera", "she"),
    ("Will", "he"),
    ("Zoe", "she"),
];

const DETERMINERS: &[&str] = &["this", "that", "every", "one", "her", "his", "our", "my"];

const PLURAL_DETERMINERS: &[&str] = &["some", "these", "those", "many", "two", "her", "his"];

/// Where something is.
const AT_PREPOSITIONS: &[&str] = &["in", "near", "under", "on", "behind", "beside", "by"];

/// Where something goes.
const TO_PREPOSITIONS: &[&str] = &["to", "into", "across", "from", "over", "past", "toward"];

const PLACES: &[&str] = &[
    "garden", "river", "village", "house", "hill", "market", "kitchen", "forest", "field",
    "bridge", "lake", "road", "mill", "school", "barn", "harbour", "station", "church", "castle",
    "island", "valley", "meadow", "shop", "yard", "tower", "well",
];

const TIMES: &[&str] = &[
    "in the morning",
    "at night",
    "every day",
    "after dinner",
    "before the rain",
    "on Monday",
    "on Sunday",
    "in the evening",
    "at noon",
    "last week",
    "in winter",
    "in the summer",
    "at dawn",
    "once again",
];

const ADVERBS: &[&str] = &[
    "slowly",
    "quietly",
    "again",
    "quickly",
    "alone",
    "together",
    "happily",
    "all day",
    "for a while",
    "loudly",
    "softly",
    "early",
    "late",
];

const LINKS: &[&str] = &["and", "but", "so", "and then", "while", "because"];

const NUMBER_WORDS: &[&str] = &[
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "twenty",
    "a hundred",
];

#[cfg(test)]
mod tests {
    use super::*;
    use strata_engine::model::data::{TokenData, TokenFormat};

    #[test]
    fn same_seed_same_text_and_prefixes_agree() {
        let long = generate(100_003, 7);
        assert_eq!(long, generate(100_003, 7));
        assert_eq!(&long[..4097], &generate(4097, 7)[..]);
        assert_ne!(long, generate(100_003, 8));
    }

    #[test]
    fn exact_size_including_zero_and_odd_sizes() {
        for bytes in [0, 1, 7, 22, 4097, 1_000_003] {
            assert_eq!(generate(bytes, 1).len(), bytes);
        }
    }

    #[test]
    fn printable_ascii_and_line_feeds_only() {
        let text = generate(200_000, 3);
        assert!(
            text.iter()
                .all(|&b| b == b'\n' || (b' '..=b'~').contains(&b)),
            "a byte outside printable ASCII"
        );
    }

    /// The text is far from uniform bytes (8 bits) and from random letters (4.7 bits):
    /// what a small model picks up first, the character frequencies, already gets its
    /// loss well below ln 256.
    #[test]
    fn unigram_entropy_below_4_6_bits() {
        let text = generate(DEFAULT_BYTES, 1337);
        let mut counts = [0u64; 256];
        for &b in &text {
            counts[b as usize] += 1;
        }
        let n = text.len() as f64;
        let bits: f64 = counts
            .iter()
            .filter(|&&c| c > 0)
            .map(|&c| {
                let p = c as f64 / n;
                -p * p.log2()
            })
            .sum();
        assert!(bits < 4.6, "unigram entropy {bits:.3} bits");
        assert!(
            bits > 3.0,
            "unigram entropy {bits:.3} bits: too repetitive to be text"
        );
    }

    #[test]
    fn reads_like_sentences() {
        let text = String::from_utf8(generate(20_000, 11)).expect("ASCII");
        let first = text.lines().next().expect("a line");
        assert!(first.starts_with(|c: char| c.is_ascii_uppercase() || c == '"'));
        assert!(text.contains(". "));
        assert!(text.contains("\n"));
        assert!(text.contains(" the "));
        assert!(!text.contains("  "), "double space in {text:.200}");
    }

    #[test]
    fn plural_rules() {
        assert_eq!(plural("box"), "boxes");
        assert_eq!(plural("bench"), "benches");
        assert_eq!(plural("cherry"), "cherries");
        assert_eq!(plural("toy"), "toys");
        assert_eq!(plural("wolf"), "wolves");
        assert_eq!(plural("cat"), "cats");
    }

    #[test]
    fn ensure_file_writes_once_and_reuses() {
        let dir = tempfile::tempdir().expect("temp dir");
        let nested = dir.path().join("corpus");
        let path = ensure_file(&nested, 10_000, 5).expect("written");
        assert_eq!(path, nested.join("strata-corpus-5-10000.txt"));
        assert_eq!(fs::read(&path).expect("read"), generate(10_000, 5));
        // The token reader takes it as raw bytes, one token each.
        let data = TokenData::open(&path).expect("opens");
        assert_eq!(data.format(), TokenFormat::Bytes);
        assert_eq!(data.len(), 10_000);
        assert_eq!(data.token(0), u32::from(generate(1, 5)[0]));
        drop(data);
        // Reused when the size is right (the content is left alone)...
        fs::write(&path, vec![b'x'; 10_000]).expect("overwrite");
        ensure_file(&nested, 10_000, 5).expect("reused");
        assert_eq!(fs::read(&path).expect("read"), vec![b'x'; 10_000]);
        // ...and rewritten when it is not.
        fs::write(&path, b"short").expect("truncate");
        ensure_file(&nested, 10_000, 5).expect("rewritten");
        assert_eq!(fs::read(&path).expect("read"), generate(10_000, 5));
        // No temporary file is left behind.
        let names: Vec<_> = fs::read_dir(&nested).expect("list").collect();
        assert_eq!(names.len(), 1);
    }
}
