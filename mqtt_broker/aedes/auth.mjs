// Passwords and access rules of one federation, evaluated as Mosquitto 2.0 evaluates its password_file and
// acl_file (the Python side, mqtt_broker/acl.py and mqtt_broker/passwords.py, holds the reference
// implementation; tests/mqtt_broker/test_cluster.py checks both give the same verdicts).
import { pbkdf2Sync, createHash, timingSafeEqual } from 'node:crypto'

export const READ = 1
export const WRITE = 2

function b64 (text) {
  if (!/^[A-Za-z0-9+/]*={0,2}$/.test(text)) throw new Error('bad base64')
  return Buffer.from(text, 'base64')
}

// Check a password against a Mosquitto '$7$' (PBKDF2-SHA512) or '$6$' (salted SHA-512) hash.
export function verifyPassword (password, hashed) {
  if (typeof hashed !== 'string') return false
  const parts = hashed.split('$')
  const pw = Buffer.isBuffer(password) ? password : Buffer.from(String(password))
  let got, want
  try {
    if (parts.length === 5 && parts[1] === '7') {
      if (!/^[0-9]+$/.test(parts[2])) return false
      const iterations = Number(parts[2])
      if (!(iterations >= 1 && iterations <= 10000000)) return false
      const salt = b64(parts[3])
      want = b64(parts[4])
      got = pbkdf2Sync(pw, salt, iterations, 64, 'sha512')
    } else if (parts.length === 4 && parts[1] === '6') {
      const salt = b64(parts[2])
      want = b64(parts[3])
      got = createHash('sha512').update(Buffer.concat([pw, salt])).digest()
    } else {
      return false
    }
  } catch (e) {
    return false
  }
  return got.length === want.length && timingSafeEqual(got, want)
}

// MQTT topic-filter matching ('+' one level, '#' the rest, including the parent level).
export function topicMatches (filter, topic) {
  const f = filter.split('/')
  const t = topic.split('/')
  for (let i = 0; i < f.length; i++) {
    if (f[i] === '#') return true
    if (i >= t.length) return false
    if (f[i] !== '+' && f[i] !== t[i]) return false
  }
  return f.length === t.length
}

function matchesRule (rule, topic) {
  if (topic.startsWith('$') && !rule.startsWith('$')) return false
  return topicMatches(rule, topic)
}

function denyFirst (rules) {
  return [...rules.filter(r => r[0] === 0), ...rules.filter(r => r[0] !== 0)]
}

function scan (rules, topic, want) {
  for (const [bits, rule] of denyFirst(rules)) {
    if (matchesRule(rule, topic)) {
      if (bits === 0) return false
      if (bits & want) return true
    }
  }
  return null
}

// Whether a client may 'read' (receive) or 'write' (publish) a concrete topic: per-user rules first, then
// the patterns (%u = username, %c = client id), deny lines first in each (Mosquitto 2.0.11's default check).
export function allows (acl, username, clientId, topic, access) {
  const want = access === 'read' ? READ : access === 'write' ? WRITE : 0
  if (!want) throw new Error(`access must be 'read' or 'write', got ${access}`)
  if (username !== null && username !== undefined) {
    const verdict = scan(acl.users[username] || [], topic, want)
    if (verdict !== null) return verdict
  }
  if (!acl.patterns.length) return false
  if ((username && /[+#]/.test(username)) || /[+#]/.test(clientId)) return false
  for (const [bits, pattern] of denyFirst(acl.patterns)) {
    const levels = pattern.split('/')
    if (levels.includes('%u') && (username === null || username === undefined)) continue
    const concrete = levels.map(l => l === '%u' ? (username || '') : l === '%c' ? clientId : l).join('/')
    if (matchesRule(concrete, topic)) {
      if (bits === 0) return false
      if (bits & want) return true
    }
  }
  return false
}

// Mosquitto grants every well-formed subscription; what a client may read is checked message by message.
export function maySubscribe (filter) {
  if (typeof filter !== 'string' || !filter || filter.includes('\u0000')) return false
  const levels = filter.split('/')
  for (let i = 0; i < levels.length; i++) {
    const l = levels[i]
    if (l.includes('#') && (l !== '#' || i !== levels.length - 1)) return false
    if (l.includes('+') && l !== '+') return false
  }
  return true
}

function checkRules (rules, what) {
  if (!Array.isArray(rules)) throw new Error(`${what}: expected a list of [bits, filter]`)
  for (const r of rules) {
    if (!Array.isArray(r) || r.length !== 2 || ![0, 1, 2, 3].includes(r[0]) || typeof r[1] !== 'string' || !maySubscribe(r[1])) {
      throw new Error(`${what}: bad rule ${JSON.stringify(r)}`)
    }
  }
  return rules
}

// The auth part of the node configuration, validated: {passwd: {user: hash}, acl: {users: {user: rules}, patterns: rules}}.
export function loadAuth (cfg) {
  if (!cfg || typeof cfg.passwd !== 'object' || cfg.passwd === null || Array.isArray(cfg.passwd)) throw new Error('passwd: expected an object of user -> hash')
  for (const [u, h] of Object.entries(cfg.passwd)) {
    if (typeof h !== 'string' || !h.startsWith('$')) throw new Error(`passwd: bad hash for ${u}`)
  }
  const acl = cfg.acl
  if (!acl || typeof acl.users !== 'object' || acl.users === null) throw new Error('acl.users: expected an object')
  const users = {}
  for (const [u, rules] of Object.entries(acl.users)) users[u] = checkRules(rules, `acl.users.${u}`)
  return { passwd: { ...cfg.passwd }, acl: { users, patterns: checkRules(acl.patterns, 'acl.patterns') } }
}
