#!/usr/bin/env node
// Reference fixtures for the C++ tokenizer of backend: llm, made with the
// Node.js binding of Hugging Face `tokenizers` (the npm package `tokenizers`,
// the same Rust core as the Python package), which installs from the npm
// registry on any machine. make_tokenizer_fixtures.py is the same with the
// Python package; this one has no encode_special_tokens (the binding lacks
// it) and trains with the binding's default BpeTrainer (no vocab limit
// beyond 30,000, no minimum frequency).
//
// Trains on a corpus it generates, shapes each tokenizer.json like a real
// family's, and writes tests/data/llm/tokenizers/npm_<name>/tokenizer.json
// and expected.json (encode with and without the template, decode with and
// without skip_special_tokens, for a fixed corpus and 600 random texts; and
// decode of random id lists):
//
//   npm_llama3_style   byte-level BPE, Llama 3's regex, ignore_merges, specials
//                      after the vocab, <|begin_of_text|> template
//   npm_llama2_style   Prepend("▁") + Replace(" ", "▁"), byte_fallback with
//                      <0x00>..<0xFF>, decoder Replace/ByteFallback/Fuse/Strip
//   npm_mistral_style  the same model with Metaspace(prepend_scheme "first",
//                      split false) instead of the normalizer (Mistral v0.3)
//   npm_qwen2_style    byte-level BPE, Qwen2's regex, NFC, no BOS
//
// From the repository root:
//
//   npm install --prefix /tmp/tokenizers-npm tokenizers@0.23.2
//   NODE_PATH=/tmp/tokenizers-npm/node_modules node tests/data/llm/make_tokenizer_fixtures_npm.js
'use strict';

const fs = require('fs');
const os = require('os');
const path = require('path');

let tokenizers;
try {
  tokenizers = require('tokenizers');
} catch (e) {
  console.error('make_tokenizer_fixtures_npm: the npm package `tokenizers` is needed ' +
                '(npm install --prefix DIR tokenizers@0.23.2, then NODE_PATH=DIR/node_modules): ' +
                e.message);
  process.exit(1);
}
const VERSION = require('tokenizers/package.json').version;
const OUT = process.argv[2] || path.join(__dirname, 'tokenizers');

const LLAMA3 = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
const QWEN2 = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
const META = '\u2581';
const LLAMA3_SPECIALS = ['<|begin_of_text|>', '<|end_of_text|>', '<|reserved_special_token_0|>',
  '<|reserved_special_token_1|>', '<|finetune_right_pad_id|>', '<|reserved_special_token_2|>',
  '<|start_header_id|>', '<|end_header_id|>', '<|eom_id|>', '<|eot_id|>', '<|python_tag|>'];
const QWEN2_SPECIALS = ['<|endoftext|>', '<|im_start|>', '<|im_end|>'];

// A fixed generator (an LCG), so that the output depends only on the seed.
let state = 12345;
function rnd() {
  state = (state * 1103515245 + 12345) & 0x7fffffff;
  return state / 0x80000000;
}
function pick(list) { return list[Math.floor(rnd() * list.length)]; }

const WORDS = ('the of and to in is was that for it with as his on be at by had are but from or ' +
  'have an they which one you were all her she there would their we him been has when who will ' +
  'no more if out so said what up its about than into them can only other new some could time ' +
  'these two may first then do any like my now over such our man me even most made after also ' +
  'did many before must through back years where much your way well down should because each ' +
  'just those people how too little state good very make world still own see men work long get ' +
  'here tokenizer model server worker request token stream decode encode weights memory device ' +
  'kernel batch prompt generate sample llama mistral qwen').split(' ');
const ACCENTED = ('café naïve résumé Ångström déjà vu façade coöperate señor über straße Zürich ' +
  'São Paulo crème brûlée garçon piñata Ærø Łódź').split(' ');
const CJK = ['日本語', '東京', 'こんにちは', 'ありがとう', '你好', '世界', '中文', '分词器', '한국어',
  '안녕하세요'];
const EMOJI = ['😀', '👍', '👍🏽', '🇫🇷', '👩‍💻', '🚀', '❤️', '✨'];
const CODE = ['def f(x):\n    return x + 1\n', 'if (a != b) { return c->d[0]; }',
  'for i in range(10):\n\tprint(i)\n', '<div class="x">text</div>', 'SELECT * FROM t WHERE id = 42;'];

function trainingCorpus() {
  const lines = [];
  for (let i = 0; i < 6000; ++i) {
    const n = 3 + Math.floor(rnd() * 16);
    const words = [];
    for (let k = 0; k < n; ++k) {
      const r = rnd();
      let w;
      if (r < 0.8) w = pick(WORDS);
      else if (r < 0.88) w = pick(ACCENTED);
      else if (r < 0.93) w = String(Math.floor(rnd() * 99999));
      else if (r < 0.96) w = pick(CJK);
      else w = pick(EMOJI);
      if (rnd() < 0.1) w = w.charAt(0).toUpperCase() + w.slice(1);
      words.push(w);
    }
    let line = words.join(' ') + pick(['.', ',', '!', '?', '', ';', "'s", "'ll"]);
    if (rnd() < 0.05) line = pick(CODE) + line;
    if (rnd() < 0.05) line = '  ' + line + '\n\n';
    lines.push(line);
  }
  return lines.join('\n');
}

function testTexts(specials) {
  const s0 = specials[0];
  const last = specials[specials.length - 1];
  const fixed = ['', ' ', 'hello world', 'Hello World! HELLO world?',
    "The model's weights aren't loaded; we'll see.", "I'M HERE, YOU'RE THERE, IT'S 'QUOTED' 'S",
    '  two leading spaces', 'trailing spaces   ', 'multiple     spaces    between',
    'tabs\tand\ttabs\t\tend', 'line one\nline two\n\nline four\r\nwindows\r\n', '\n\n\n', '   \n   \n',
    'café naïve résumé Ångström', 'e\u0301 combining acute, n\u0303 and A\u030a',
    '日本語のテキストです。東京は大きい。', '你好，世界！这是分词器的测试。', '안녕하세요 세계',
    'emoji 😀👍🏽 🇫🇷 👩‍💻 🚀🚀🚀 ❤️', 'numbers 1234567890 3.14159 -42 1,000,000',
    'mixed\u3000ideographic\u00a0nbsp\u2003em\u180emongolian', 'control \x01\x02\x7f bytes',
    'rare 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ℌ𝔢𝔩𝔩𝔬 and ﬁ ligature', '<div class="x">text</div> && a->b[0] != c;',
    'def f(x):\n    return x + 1\n', 'a'.repeat(1000), 'ab'.repeat(500), 'hello '.repeat(200),
    ' '.repeat(100), '\n'.repeat(50), '😀'.repeat(60), '日本'.repeat(100), s0 + 'hello' + last,
    'text ' + s0 + ' with ' + last + 'specials ' + s0 + s0, 'almost ' + s0.slice(0, -1) + ' special',
    s0, '\u2581 the meta symbol itself', "ſ 'ſ 'K 'K"];
  // Random texts from pieces that stress the regexes, NFC and the merges.
  const atoms = [' ', '  ', '\t', '\n', '\r\n', '\r', '\u00a0', '\u180e', '\u2028', '\u0085',
    '\u3000', '\u200b', '\u2003', "'s", "'S", "'ll", "'LL", "'re", "'Ve", "'d", "'", '"', '.', ',',
    '!?', '...', '--', '(', ')', '{}', '<', '>', '/', '\\', '_', '#', 'a', 'b', 'Z', 'hello', 'world',
    'The', 'tokenizer', 'x', 'q', '0', '7', '12', '345', '6789', '3.14', '٣', '¼', 'Ⅻ', 'é',
    'e\u0301', 'A\u030a', 'ñ', 'ß', 'ſ', 'ﬁ', 'Ω', '\u2126', 'ά', '\u1100\u1161', '한', '日', '本',
    '語', '你好', 'こんにちは', 'カタカナ', '한국어', '😀', '👍🏽', '🇫🇷', '👩‍💻', '𝔘', '\u{10FFFF}',
    '\uE000', '\uFFFD', '\u2581', '\u0120', '\x00', '\x01', '\x1f', '\x7f'].concat(specials);
  const random = [];
  for (let i = 0; i < 600; ++i) {
    const n = 1 + Math.floor(rnd() * 20);
    let s = '';
    for (let k = 0; k < n; ++k) s += pick(atoms);
    random.push(s);
  }
  return fixed.concat(random);
}

function bpe(flags) {
  return Object.assign({type: 'BPE', dropout: null, unk_token: null, continuing_subword_prefix: null,
    end_of_word_suffix: null, fuse_unk: false, byte_fallback: false, ignore_merges: false,
    vocab: {}, merges: []}, flags);
}
function tokenizerJson(model, normalizer, preTokenizer, decoder) {
  return {version: '1.0', truncation: null, padding: null, added_tokens: [], normalizer,
    pre_tokenizer: preTokenizer, post_processor: null, decoder, model};
}
function added(id, content) {
  return {id, content, single_word: false, lstrip: false, rstrip: false, normalized: false,
    special: true};
}
function template(token, id) {
  const special = (typeId) => ({SpecialToken: {id: token, type_id: typeId}});
  const sequence = (name, typeId) => ({Sequence: {id: name, type_id: typeId}});
  return {type: 'TemplateProcessing', single: [special(0), sequence('A', 0)],
    pair: [special(0), sequence('A', 0), special(1), sequence('B', 1)],
    special_tokens: {[token]: {id: token, ids: [id], tokens: [token]}}};
}
const BYTE_LEVEL_DECODER = {type: 'ByteLevel', add_prefix_space: true, trim_offsets: true,
  use_regex: true};
const BYTE_LEVEL_PROCESSOR = {type: 'ByteLevel', add_prefix_space: true, trim_offsets: false,
  use_regex: true};
function byteLevelPreTokenizer(pattern) {
  return {type: 'Sequence', pretokenizers: [
    {type: 'Split', pattern: {Regex: pattern}, behavior: 'Isolated', invert: false},
    {type: 'ByteLevel', add_prefix_space: false, trim_offsets: true, use_regex: false}]};
}

function train(json, corpusFile, scratch) {
  const tok = tokenizers.Tokenizer.fromString(JSON.stringify(json));
  tok.train([corpusFile]);
  tok.save(scratch, false);
  return JSON.parse(fs.readFileSync(scratch, 'utf8'));
}
// The 256 byte characters, as Llama 3 and Qwen2 have them all.
function addByteCharacters(json) {
  let next = Object.keys(json.model.vocab).length;
  // In code point order: the binding gives the alphabet in a hash set's order.
  const alphabet = tokenizers.byteLevelAlphabet().sort((a, b) => a.codePointAt(0) - b.codePointAt(0));
  for (const c of alphabet) {
    if (!(c in json.model.vocab)) json.model.vocab[c] = next++;
  }
  return next;
}

async function expectations(json, specials) {
  const tok = tokenizers.Tokenizer.fromString(JSON.stringify(json));
  const encode = [];
  for (const text of testTexts(specials)) {
    const ids = (await tok.encode(text, null, {addSpecialTokens: false})).getIds();
    const idsSpecial = (await tok.encode(text, null, {addSpecialTokens: true})).getIds();
    encode.push({text, ids, ids_add_special: idsSpecial,
      decoded: await tok.decode(idsSpecial, false),
      decoded_skip_special: await tok.decode(idsSpecial, true)});
  }
  const size = tok.getVocabSize(true);
  const decode = [];
  for (let i = 0; i < 300; ++i) {
    const n = 1 + Math.floor(rnd() * 24);
    const bound = i % 3 === 0 ? Math.min(size, 300) : size;  // bytes, in odd orders
    const ids = [];
    for (let k = 0; k < n; ++k) ids.push(Math.floor(rnd() * bound));
    decode.push({ids, text: await tok.decode(ids, false),
      text_skip_special: await tok.decode(ids, true)});
  }
  return {vocab_size: size, encode, decode};
}

// One case a line, so that a change reads as a diff.
function writeExpected(file, header, body) {
  const lines = ['{'];
  for (const [k, v] of Object.entries(header)) lines.push(JSON.stringify(k) + ': ' + JSON.stringify(v) + ',');
  lines.push('"vocab_size": ' + body.vocab_size + ',');
  lines.push('"encode": [');
  lines.push(body.encode.map((c) => JSON.stringify(c)).join(',\n'));
  lines.push('],');
  lines.push('"decode": [');
  lines.push(body.decode.map((c) => JSON.stringify(c)).join(',\n'));
  lines.push(']', '}');
  fs.writeFileSync(file, lines.join('\n') + '\n');
}

async function main() {
  const scratch = fs.mkdtempSync(path.join(os.tmpdir(), 'tokenizer-fixtures-'));
  const corpusFile = path.join(scratch, 'corpus.txt');
  fs.writeFileSync(corpusFile, trainingCorpus());
  const made = [];

  let d = train(tokenizerJson(bpe({ignore_merges: true}), null, byteLevelPreTokenizer(LLAMA3),
                              BYTE_LEVEL_DECODER), corpusFile, path.join(scratch, 't.json'));
  let n = addByteCharacters(d);
  d.model.ignore_merges = true;
  d.added_tokens = LLAMA3_SPECIALS.map((s, i) => added(n + i, s));
  d.post_processor = {type: 'Sequence', processors: [BYTE_LEVEL_PROCESSOR,
    template('<|begin_of_text|>', n)]};
  made.push(['npm_llama3_style', d, LLAMA3_SPECIALS]);

  // Trained with Metaspace, so that no merge crosses a word (as SentencePiece's
  // pieces never do); then <0x00>..<0xFF> as ids 3..258, as in Llama 2's vocab.
  const metaspace = {type: 'Metaspace', replacement: META, prepend_scheme: 'always', split: true};
  d = train(tokenizerJson(bpe({unk_token: '<unk>'}), null, metaspace, metaspace), corpusFile,
            path.join(scratch, 't.json'));
  const vocab = {'<unk>': 0, '<s>': 1, '</s>': 2};
  for (let b = 0; b < 256; ++b) vocab['<0x' + b.toString(16).toUpperCase().padStart(2, '0') + '>'] = 3 + b;
  let next = 259;
  for (const [token] of Object.entries(d.model.vocab).sort((a, b) => a[1] - b[1])) {
    if (!(token in vocab)) vocab[token] = next++;
  }
  d.model.vocab = vocab;
  Object.assign(d.model, {byte_fallback: true, fuse_unk: true, unk_token: '<unk>'});
  d.added_tokens = [added(0, '<unk>'), added(1, '<s>'), added(2, '</s>')];
  d.normalizer = {type: 'Sequence', normalizers: [{type: 'Prepend', prepend: META},
    {type: 'Replace', pattern: {String: ' '}, content: META}]};
  d.pre_tokenizer = null;
  d.decoder = {type: 'Sequence', decoders: [{type: 'Replace', pattern: {String: META}, content: ' '},
    {type: 'ByteFallback'}, {type: 'Fuse'}, {type: 'Strip', content: ' ', start: 1, stop: 0}]};
  d.post_processor = template('<s>', 1);
  made.push(['npm_llama2_style', d, ['<s>', '</s>', '<unk>']]);
  const mistral = JSON.parse(JSON.stringify(d));
  mistral.normalizer = null;
  mistral.pre_tokenizer = {type: 'Metaspace', replacement: META, prepend_scheme: 'first',
    split: false};
  made.push(['npm_mistral_style', mistral, ['<s>', '</s>', '<unk>']]);

  d = train(tokenizerJson(bpe({}), {type: 'NFC'}, byteLevelPreTokenizer(QWEN2), BYTE_LEVEL_DECODER),
            corpusFile, path.join(scratch, 't.json'));
  n = addByteCharacters(d);
  d.added_tokens = QWEN2_SPECIALS.map((s, i) => added(n + i, s));
  d.post_processor = BYTE_LEVEL_PROCESSOR;
  made.push(['npm_qwen2_style', d, QWEN2_SPECIALS]);

  const command = 'NODE_PATH=/tmp/tokenizers-npm/node_modules node tests/data/llm/make_tokenizer_fixtures_npm.js';
  for (const [name, json, specials] of made) {
    const body = await expectations(json, specials);
    const folder = path.join(OUT, name);
    fs.mkdirSync(folder, {recursive: true});
    fs.writeFileSync(path.join(folder, 'tokenizer.json'), JSON.stringify(json, null, 1) + '\n');
    writeExpected(path.join(folder, 'expected.json'),
                  {name, command, versions: {tokenizers_npm: VERSION, node: process.version}}, body);
    console.log(`${name}: ${body.vocab_size} tokens (with added), ${body.encode.length} encode ` +
                `cases, ${body.decode.length} decode cases -> ${folder}`);
  }
  fs.rmSync(scratch, {recursive: true, force: true});
  console.log(`made by: ${command} (tokenizers ${VERSION}, node ${process.version})`);
}

main().catch((e) => {
  console.error('make_tokenizer_fixtures_npm: ' + (e.stack || e));
  process.exit(1);
});
