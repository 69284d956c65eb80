// One node of the clustered broker: an Aedes MQTT broker whose retained messages, subscriptions and
// queued QoS 1 messages live in Redis (aedes-persistence-redis) and whose messages reach the other nodes
// through Redis (mqemitter-redis). Started (and stopped by PID) by mqtt_broker/cluster.py:
//
//   node node.mjs --config STATE/cluster/aedes.json --port 1884 --name node-1
//
// It enforces what the generated Mosquitto configuration enforces: no anonymous clients, the passwd
// hashes and ACL rules Python wrote into the config file (auth.mjs), the client id equal to the username,
// max_packet_size (a larger packet closes the connection), QoS 1, retained messages and persistent
// sessions. A publish the ACL denies is acknowledged and dropped, as Mosquitto does. A will is accepted
// only on the client's own status topic, at CONNECT and again when a surviving node delivers the will of a
// client of a node that died. SIGHUP re-reads the
// config file (passwords, ACL) and closes the connections of users no longer in it or whose password
// entry changed (a rotation); SIGTERM stops.
//
//   node node.mjs --check < cases.jsonl   answers ACL/password questions (one JSON per line) for the tests
import { readFileSync } from 'node:fs'
import { createServer } from 'node:net'
import { createInterface } from 'node:readline'
import { Aedes } from 'aedes'
import Redis from 'ioredis'
import mqtt from 'mqtt-packet'
import redisPersistence from 'aedes-persistence-redis'
import mqemitterRedis from 'mqemitter-redis'
import { allows, loadAuth, maySubscribe, verifyPassword } from './auth.mjs'

function log (...parts) {
  const ts = new Date().toISOString().slice(0, 19)
  process.stderr.write(`${ts}: ${parts.join(' ')}\n`)
}

function parseArgs (argv) {
  const out = {}
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i]
    if (a === '--check') { out.check = true; continue }
    if (!['--config', '--port', '--name'].includes(a) || i + 1 >= argv.length) {
      throw new Error(`usage: node node.mjs --config FILE --port P --name NAME | --check (bad argument ${JSON.stringify(a)})`)
    }
    out[a.slice(2)] = argv[++i]
  }
  return out
}

function readConfig (path) {
  let cfg
  try {
    cfg = JSON.parse(readFileSync(path, 'utf8'))
  } catch (e) {
    throw new Error(`${path}: unreadable node config: ${e.message}`)
  }
  const auth = loadAuth(cfg)
  const mps = cfg.max_packet_size
  if (!Number.isInteger(mps) || mps < 1024 || mps > 268435455) throw new Error(`${path}: bad max_packet_size ${mps}`)
  const r = cfg.redis
  if (!r || typeof r.host !== 'string' || !Number.isInteger(r.port) || typeof r.password !== 'string') {
    throw new Error(`${path}: redis needs host, port and password`)
  }
  if (typeof cfg.host !== 'string' || !cfg.host) throw new Error(`${path}: bad host`)
  return { ...cfg, ...auth }
}

// Packets larger than max_packet_size (fixed header + remaining length) close the connection before their
// body is read, as Mosquitto does; one check in the parser's length state covers every client.
function limitPacketSize (getLimit) {
  const proto = Object.getPrototypeOf(mqtt.parser())
  const parseLength = proto._parseLength
  proto._parseLength = function () {
    const done = parseLength.call(this)
    if (done && this.client) {
      const n = this.packet.length
      const size = 1 + (n < 128 ? 1 : n < 16384 ? 2 : n < 2097152 ? 3 : 4) + n // fixed header + remaining length
      if (size > getLimit()) {
        this._emitError(new Error(`packet of ${size} bytes exceeds max_packet_size ${getLimit()}`))
        return false
      }
    }
    return done
  }
}

const DENIED = Symbol('denied')

// A will may go only to the client's own status topic (fl/<federation>/status/<client id>, what every
// device sets), and only where the ACL lets that user publish.
function mayWill (cfg, user, topic) {
  return typeof topic === 'string' && topic === `fl/${cfg.federation}/status/${user}` &&
    allows(cfg.acl, user, user, topic, 'write')
}

async function serve (args) {
  const port = Number(args.port)
  if (!Number.isInteger(port) || port < 1 || port > 65535) throw new Error(`--port must be 1-65535, got ${args.port}`)
  if (!args.config || !args.name) throw new Error('--config and --name are required')
  let cfg = readConfig(args.config)
  limitPacketSize(() => cfg.max_packet_size)
  const redis = { host: cfg.redis.host, port: cfg.redis.port, password: cfg.redis.password }
  // every connection ready before use: a subscriber connection that enters subscriber mode before its
  // ready check fails the check
  const connect = () => new Promise((resolve, reject) => {
    const conn = new Redis({ ...redis, lazyConnect: true })
    conn.connect().then(() => resolve(conn), reject)
  })
  const [conn, subConn, pubConn] = await Promise.all([connect(), connect(), connect()])
  const persistence = redisPersistence({ conn })
  // Aedes stores a persistent client's SUBSCRIBE once per topic filter, each time with the packet's whole
  // list; the persistence waits for its own broadcast keyed by (client, first topic), so concurrent calls
  // for one packet overwrite each other's waiter and the SUBSCRIBE never completes (no SUBACK, no retained
  // messages). One store per packet: the calls that share the list share the first call's promise.
  const addSubscriptions = persistence.addSubscriptions.bind(persistence)
  const storing = new WeakMap()
  persistence.addSubscriptions = (client, subs) => {
    if (!storing.has(subs)) storing.set(subs, addSubscriptions(client, subs))
    return storing.get(subs)
  }
  const mq = mqemitterRedis({ subConn, pubConn })
  const broker = new Aedes({
    id: `${cfg.federation}-${args.name}`,
    persistence,
    mq,
    concurrency: 1000,
    queueLimit: 10000,
    maxClientsIdLength: 65535,
    heartbeatInterval: 5000
  })

  broker.authenticate = (client, username, password, done) => {
    const refuse = (why, code) => {
      log(`${args.name}: refused ${JSON.stringify(client.id)}: ${why}`)
      const err = new Error(why)
      err.returnCode = code
      done(err, false)
    }
    if (username === undefined || username === null || password === undefined || password === null) return refuse('no username/password', 4)
    const hashed = Object.hasOwn(cfg.passwd, username) ? cfg.passwd[username] : null
    if (!hashed || !verifyPassword(password, hashed)) return refuse(`bad username or password for ${JSON.stringify(username)}`, 4)
    if (client.id !== username) return refuse(`client id differs from the username ${JSON.stringify(username)}`, 5)
    // Aedes does not authorise a will at CONNECT, and a surviving node publishes a dead node's wills with no
    // client to check: a will is accepted only on the client's own status topic, and only if the ACL lets
    // the client publish there (Mosquitto refuses a will the ACL denies with the same code)
    if (client._will && !mayWill(cfg, username, client._will.topic)) {
      return refuse(`will on ${JSON.stringify(client._will.topic)} is not the client's own status topic`, 5)
    }
    client.flayerUser = username
    client.flayerHash = hashed // the password entry it was accepted under: a rotation replaces it
    done(null, true)
  }
  // a connection stays valid while its user's password entry is the one it was accepted under (Mosquitto
  // checks an open connection's password again on a reload: a revoked or rotated kit is closed there too)
  const stillValid = c => Object.hasOwn(cfg.passwd, c.flayerUser) && cfg.passwd[c.flayerUser] === c.flayerHash
  broker.authorizePublish = (client, packet, done) => {
    if (client === null) {
      // the will of a client of a node that died, published by this node: checked again under today's rules
      // (its client id is the username it was accepted under; a revoked user's will is dropped too)
      const owner = packet.clientId
      if (typeof owner !== 'string' || !Object.hasOwn(cfg.passwd, owner) || !mayWill(cfg, owner, packet.topic)) {
        log(`${args.name}: dropped the will of ${JSON.stringify(owner)} on ${JSON.stringify(packet.topic)}`)
        packet[DENIED] = true // dropped, and removed from the store like a delivered will (no error: Aedes
        // would emit it as a broker error and keep the will for the next sweep)
      }
      return done(null)
    }
    if (packet.topic.startsWith('$SYS')) return done(new Error('$SYS topics are reserved'))
    // a user revoked or rotated since it connected publishes nothing, not even the will its closing connection sends
    if (!stillValid(client) || !allows(cfg.acl, client.flayerUser, client.id, packet.topic, 'write')) {
      log(`${args.name}: denied publish by ${client.flayerUser} to ${packet.topic}`)
      packet[DENIED] = true // acknowledged (QoS 1) and dropped, as Mosquitto does
    }
    done(null)
  }
  const publish = broker.publish.bind(broker)
  broker.publish = (packet, client, done) => packet[DENIED] ? setImmediate(done) : publish(packet, client, done)
  broker.authorizeSubscribe = (client, sub, done) => done(null, maySubscribe(sub.topic) ? sub : null)
  broker.authorizeForward = (client, packet) => {
    if (packet.topic.startsWith('$SYS')) return null
    return allows(cfg.acl, client.flayerUser, client.id, packet.topic, 'read') ? packet : null
  }
  broker.on('client', c => log(`${args.name}: client ${c.id} connected`))
  broker.on('clientDisconnect', c => log(`${args.name}: client ${c.id} disconnected`))
  broker.on('clientError', (c, err) => log(`${args.name}: client ${c && c.id} error: ${err.message}`))
  broker.on('connectionError', (c, err) => log(`${args.name}: connection error: ${err.message}`))
  await broker.listen()

  const server = createServer(broker.handle)
  await new Promise((resolve, reject) => {
    server.once('error', reject)
    server.listen(port, cfg.host, resolve)
  })
  log(`${args.name}: listening on ${cfg.host}:${port} (federation ${cfg.federation}, redis ${redis.host}:${redis.port})`)

  process.on('SIGHUP', () => {
    try {
      cfg = readConfig(args.config)
    } catch (e) {
      log(`${args.name}: reload failed, keeping the old rules: ${e.message}`)
      return
    }
    for (const c of Object.values(broker.clients)) {
      if (c.flayerUser && !stillValid(c)) {
        log(`${args.name}: closing ${c.id}: ${Object.hasOwn(cfg.passwd, c.flayerUser) ? 'its password changed' : 'no longer a user'}`)
        c.close()
      }
    }
    log(`${args.name}: reloaded passwords and ACL`)
  })
  let stopping = false
  const stop = () => {
    if (stopping) return
    stopping = true
    log(`${args.name}: stopping`)
    server.close()
    broker.close(() => process.exit(0))
    setTimeout(() => process.exit(0), 3000).unref()
  }
  process.on('SIGTERM', stop)
  process.on('SIGINT', stop)
}

// --check: {"acl": {...}, "passwd": {...}} first, then {"user", "client", "topic", "access"} or
// {"password", "hash"} or {"filter"} per line; one JSON answer per line.
async function check () {
  let auth = null
  for await (const line of createInterface({ input: process.stdin })) {
    if (!line.trim()) continue
    const q = JSON.parse(line)
    if (auth === null) { auth = loadAuth(q); process.stdout.write('true\n'); continue }
    let a
    if ('hash' in q) a = verifyPassword(q.password, q.hash)
    else if ('filter' in q) a = maySubscribe(q.filter)
    else a = allows(auth.acl, q.user, q.client, q.topic, q.access)
    process.stdout.write(JSON.stringify(a) + '\n')
  }
}

try {
  const args = parseArgs(process.argv.slice(2))
  await (args.check ? check() : serve(args))
} catch (e) {
  log(`aedes node: ${e.message}`)
  process.exit(2)
}
