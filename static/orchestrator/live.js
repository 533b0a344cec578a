/* Live updates for the task list and the task page, over the websockets of
 * orchestrator/consumers.py. Plain JavaScript: no libraries, nothing from a CDN.
 *
 * The server renders every change with the templates the page itself was rendered with
 * (orchestrator/presenters/fragments.py) and sends it as fragments:
 * {"target": <element id>, "html": ..., "swap": "outerHTML" | "afterbegin"}. This script
 * only swaps them in; it builds no markup and decides nothing about what a page shows.
 * What is left here is what only a browser can do: the connection indicator, reconnecting
 * with the last event seq seen, the outage banner, keeping what the user is typing across
 * a swap, counting the heartbeat age up between updates, and selecting the task page's tab
 * (the server decides which tabs there are).
 *
 * The task page (`[data-live-task]`): /ws/tasks/<id>/?resume_from=<last seq seen>. Each
 * `event` (seq n) carries the fragment that adds its row; it is applied once, in seq order
 * (a replayed event already shown is skipped). `fragments` messages carry the regions that
 * changed. {"type": "reload"} asks for a page reload. The initial seq comes from the
 * server-rendered page, so a page load followed by a connect has no gap.
 *
 * The list page (`[data-live-list]`): /ws/tasks/ sends `fragments` with the changed tasks'
 * rows, and a `task` message per change, from which new tasks are announced on the
 * newest page.
 */
(function () {
  "use strict";

  var MIN_DELAY = 500;   // first reconnect delay (ms)
  var MAX_DELAY = 5000;  // reconnect delay cap (ms)

  function qs(selector, root) { return (root || document).querySelector(selector); }
  function qsa(selector, root) { return Array.prototype.slice.call((root || document).querySelectorAll(selector)); }
  function tid(name) { return '[data-testid="' + name + '"]'; }
  function toInt(value, fallback) { var n = parseInt(value, 10); return isNaN(n) ? fallback : n; }
  function setText(node, text) { text = String(text); if (node && node.textContent !== text) node.textContent = text; }

  // --- the swapper -------------------------------------------------------------------------
  // A field's identity across a swap: its form's control name and its own name.
  function fieldKey(field) {
    var form = field.closest("[data-action]");
    return (form ? form.getAttribute("data-action") : "") + "|" + (field.name || field.id || "");
  }

  function isTyped(field) {
    if (field instanceof HTMLSelectElement) {
      return qsa("option", field).some(function (o) { return o.selected !== o.defaultSelected; });
    }
    return field.type !== "hidden" && field.value !== field.defaultValue;
  }

  // What the user typed (a terminate reason, a chosen step) survives a region swap.
  function keepUserInput(from, to) {
    var typed = {};
    qsa("input, select, textarea", from).forEach(function (field) {
      if (isTyped(field)) typed[fieldKey(field)] = field.value;
    });
    var focused = document.activeElement && from.contains(document.activeElement) ? fieldKey(document.activeElement) : null;
    var refocus = null;
    qsa("input, select, textarea", to).forEach(function (field) {
      var key = fieldKey(field);
      if (Object.prototype.hasOwnProperty.call(typed, key)) field.value = typed[key];
      if (key === focused) refocus = field;
    });
    return refocus;
  }

  // A region is not replaced while the mouse button is down inside it: the press and the
  // release would land on different elements, and the browser then sends the click to their
  // common ancestor (a link or a button pressed as an update arrives does nothing). Its update
  // waits for the release (and the click after it), or at most HOLD_MAX ms.
  var HOLD_MAX = 2000;
  var pressed = null;
  var held = [];

  function releasePress() {
    pressed = null;
    var waiting = held;
    held = [];
    document.documentElement.removeAttribute("data-live-held");
    waiting.forEach(swap);
    if (waiting.length) applied();
  }

  document.addEventListener("pointerdown", function (event) {
    pressed = event.target;
    window.setTimeout(function () { if (pressed === event.target) releasePress(); }, HOLD_MAX);
  }, true);
  ["pointerup", "pointercancel"].forEach(function (name) {
    // After the click that follows the release (dispatched before any timer runs).
    document.addEventListener(name, function () { window.setTimeout(releasePress, 0); }, true);
  });

  function swap(fragment) {
    var target = document.getElementById(fragment.target);
    if (!target) return;  // a region this page does not have (e.g. a row on another page)
    if (pressed && fragment.swap !== "afterbegin" && target.contains(pressed)) {
      held.push(fragment);
      document.documentElement.setAttribute("data-live-held", String(held.length));  // for the browser tests
      return;
    }
    var template = document.createElement("template");
    template.innerHTML = fragment.html;
    if (fragment.swap === "afterbegin") {
      qsa("[data-placeholder]", target).forEach(function (node) { node.parentNode.removeChild(node); });
      target.insertBefore(template.content, target.firstChild);
      var max = toInt(target.getAttribute("data-max-rows"), 0);
      while (max && target.children.length > max) target.removeChild(target.lastElementChild);
    } else {
      var replacement = template.content.firstElementChild;
      if (!replacement) return;
      var refocus = keepUserInput(target, replacement);
      // A focused element with an id (a tab) keeps the focus across the swap.
      var focusedId = document.activeElement && target.contains(document.activeElement) ? document.activeElement.id : "";
      target.parentNode.replaceChild(replacement, target);
      if (!refocus && focusedId) refocus = document.getElementById(focusedId);
      if (refocus) refocus.focus();
    }
  }

  function applyFragments(fragments) {
    (fragments || []).forEach(swap);
    applied();
  }

  function applied() {
    if (selectedTab) selectTab(selectedTab);  // a swapped tablist comes as the server renders it
    tickHeartbeat();
  }

  // --- the task page's tabs ----------------------------------------------------------------
  // The server renders the tablist (task/_tabs.html: which sections apply, their counts; a
  // live region) and every panel, a hidden one too (its regions keep receiving updates).
  // This only selects one: from the URL hash (#effects, or the id of an element inside a
  // panel, e.g. #task-inbox), on a click, or with the arrow keys, Home and End; the selection
  // goes into the hash, so a reload or a shared link opens the same tab, and into the forms
  // the page posts, so a control's redirect comes back to it.
  var selectedTab = null;

  function tabs() { return qsa('#task-tabs [role="tab"]'); }
  function tabKey(tab) { return tab.getAttribute("data-tab"); }

  function tabFromHash() {
    var hash = window.location.hash.replace(/^#/, "");
    try { hash = decodeURIComponent(hash); } catch (err) { return null; }
    if (!hash) return null;
    if (tabs().some(function (tab) { return tabKey(tab) === hash; })) return hash;
    var target = document.getElementById(hash);
    var panel = target && target.closest("[data-tab-panel]");
    return panel ? panel.getAttribute("data-tab-panel") : null;
  }

  function selectTab(key, options) {
    options = options || {};
    var all = tabs();
    if (!all.length) return;
    if (!all.some(function (tab) { return tabKey(tab) === key; })) key = tabKey(all[0]);  // no longer applies
    selectedTab = key;
    all.forEach(function (tab) {
      var on = tabKey(tab) === key;
      if (tab.getAttribute("aria-selected") !== String(on)) tab.setAttribute("aria-selected", String(on));
      tab.tabIndex = on ? 0 : -1;
      if (on && options.focus) tab.focus();
    });
    qsa("[data-tab-panel]").forEach(function (panel) {
      var hidden = panel.getAttribute("data-tab-panel") !== key;
      if (panel.hidden !== hidden) panel.hidden = hidden;
    });
    if (options.record && window.history && window.history.replaceState) {
      window.history.replaceState(window.history.state, "", window.location.pathname + window.location.search + "#" + key);
    }
  }

  function followHash() {
    var key = tabFromHash();
    if (!key) return;
    selectTab(key);
    var hash = window.location.hash.slice(1);
    var target = hash && hash !== key ? document.getElementById(hash) : null;
    if (target) target.scrollIntoView();  // shown only now: the browser could not scroll to it
  }

  function initTabs() {
    selectTab(tabFromHash() || tabKey(tabs()[0]));
    followHash();
    window.addEventListener("hashchange", followHash);
    function selectClicked(event) {
      var tab = event.target.closest && event.target.closest('#task-tabs [role="tab"]');
      if (tab) selectTab(tabKey(tab), {record: true});
    }
    document.addEventListener("click", selectClicked);  // a click, and Enter or Space on a tab
    // Live updates swap the tablist (its counts): a swap between the press and the release
    // would take the click away from the replaced button (it then goes to their common
    // ancestor), so the press selects the tab too.
    document.addEventListener("pointerdown", function (event) { if (event.button === 0) selectClicked(event); });
    document.addEventListener("keydown", function (event) {
      var tab = event.target.closest && event.target.closest('#task-tabs [role="tab"]');
      if (!tab) return;
      var all = tabs().filter(function (t) { return !t.hidden; });
      var at = all.indexOf(tab);
      var next = {ArrowRight: at + 1, ArrowLeft: at - 1, Home: 0, End: all.length - 1}[event.key];
      if (next === undefined) return;
      event.preventDefault();
      next = (next + all.length) % all.length;
      selectTab(tabKey(all[next]), {record: true, focus: true});
    });
    // A form posted from this page comes back to the selected tab: a redirect without a
    // fragment keeps the one of the URL it was posted to.
    document.addEventListener("submit", function (event) {
      var form = event.target;
      if (!(form instanceof HTMLFormElement) || !selectedTab || (form.method || "").toLowerCase() !== "post") return;
      var action = form.getAttribute("action") || "";
      if (action.indexOf("#") < 0) form.setAttribute("action", action + "#" + selectedTab);
    });
  }

  // The heartbeat age as rendered (data-age), counted up since it arrived.
  function tickHeartbeat() {
    var now = Date.now();
    qsa(tid("heartbeat-age") + "[data-age]").forEach(function (node) {
      if (!node.hasAttribute("data-shown-at")) node.setAttribute("data-shown-at", String(now));
      var age = Number(node.getAttribute("data-age")) + (now - Number(node.getAttribute("data-shown-at"))) / 1000;
      setText(node, age.toFixed(1));
    });
  }

  // --- the socket: reconnects with backoff, shows its state -------------------------------
  function LiveSocket(options) {
    this.url = options.url;            // function returning the ws URL (read at each connect)
    this.onMessage = options.onMessage;
    this.indicator = options.indicator;
    this.delay = MIN_DELAY;
    this.stopped = false;
    this.connect();
    var self = this;
    window.addEventListener("pagehide", function () { self.stop(); });
    window.addEventListener("pageshow", function (event) {
      if (event.persisted && self.stopped) {  // back from the bfcache
        self.stopped = false;
        self.delay = MIN_DELAY;
        self.connect();
      }
    });
  }

  // The server says the database is unreachable (or back): a banner, so nobody mistakes a
  // frozen page for a quiet one.
  function showOutage(down) {
    var banner = qs(tid("outage-banner"));
    if (!banner) return;
    banner.hidden = !down;
    banner.style.display = down ? "" : "none";
  }

  LiveSocket.prototype.setIndicator = function (state, text) {
    var node = this.indicator;
    if (!node) return;
    node.hidden = false;
    node.setAttribute("data-state", state);
    setText(node, text);
    node.title = state === "live" ? "Updates arrive live" : "Connection lost; reconnecting";
  };

  LiveSocket.prototype.connect = function () {
    if (this.stopped) return;
    var self = this;
    var scheme = window.location.protocol === "https:" ? "wss://" : "ws://";
    var socket;
    try {
      socket = new WebSocket(scheme + window.location.host + this.url());
    } catch (err) {
      this.retry();
      return;
    }
    this.socket = socket;
    socket.onopen = function () { self.setIndicator("live", "live"); };
    socket.onmessage = function (message) {
      self.delay = MIN_DELAY;  // the server answered: the next drop starts the backoff afresh
      var data;
      try { data = JSON.parse(message.data); } catch (err) { return; }
      if (data && data.type === "reload") {
        self.stop();
        window.location.reload();
        return;
      }
      if (data && data.type === "outage") {
        showOutage(data.database === "unreachable");
        return;
      }
      try { self.onMessage(data); } catch (err) { if (window.console) console.error("live update failed", err); }
    };
    socket.onclose = function (event) {
      if (self.socket === socket) self.socket = null;
      if (event && event.code === 4503) showOutage(true);  // refused: the database is unreachable
      self.retry();
    };
  };

  LiveSocket.prototype.retry = function () {
    if (this.stopped) return;
    this.setIndicator("reconnecting", "reconnecting…");
    var self = this;
    var delay = this.delay;
    this.delay = Math.min(MAX_DELAY, this.delay * 2);
    clearTimeout(this.timer);
    this.timer = setTimeout(function () { self.connect(); }, delay);
  };

  LiveSocket.prototype.stop = function () {
    this.stopped = true;
    clearTimeout(this.timer);
    if (this.socket) { try { this.socket.close(); } catch (err) { /* already closed */ } }
  };

  // --- the task list -----------------------------------------------------------------------
  function initList(table) {
    var newest = table.getAttribute("data-live-newest") === "1";
    var maxId = 0;
    qsa("tr[data-task-id]", table).forEach(function (row) { maxId = Math.max(maxId, toInt(row.getAttribute("data-task-id"), 0)); });
    var unseen = {};
    var notice = qs(tid("new-tasks-notice"));

    // A task this page has no row for, newer than its rows: announce it, on the newest page.
    function noteNew(id) {
      if (!newest || id <= maxId || document.getElementById("task-row-" + id)) return;
      unseen[id] = true;
      var count = Object.keys(unseen).length;
      if (!notice) return;
      setText(qs("a", notice) || notice, count + (count === 1 ? " new task" : " new tasks") + " — refresh");
      notice.hidden = false;
    }

    new LiveSocket({
      url: function () { return "/ws/tasks/"; },
      indicator: qs(tid("live-indicator")),
      onMessage: function (msg) {
        if (msg.type === "fragments") applyFragments(msg.fragments);
        else if (msg.type === "task") noteNew(msg.id);
        else if (msg.type === "state") (msg.tasks || []).forEach(function (task) { noteNew(task.id); });
      }
    });
  }

  // --- the task page -----------------------------------------------------------------------
  function initDetail(header) {
    var taskId = header.getAttribute("data-task-id");
    var lastSeq = toInt(header.getAttribute("data-seq"), 0);
    // Events the server rendered after reading the task (a race) count as seen.
    qsa(tid("event-row")).forEach(function (row) { lastSeq = Math.max(lastSeq, toInt(row.getAttribute("data-seq"), 0)); });

    setInterval(tickHeartbeat, 1000);

    new LiveSocket({
      url: function () { return "/ws/tasks/" + encodeURIComponent(taskId) + "/?resume_from=" + lastSeq; },
      indicator: qs(tid("live-indicator")),
      onMessage: function (msg) {
        if (msg.type === "event") {
          if (msg.seq <= lastSeq) return;  // already shown
          lastSeq = msg.seq;
          header.setAttribute("data-seq", lastSeq);
          applyFragments(msg.fragments);
        } else if (msg.type === "fragments") {
          applyFragments(msg.fragments);
        }
      }
    });
  }

  function init() {
    if (qs("#task-tabs")) initTabs();
    if (!("WebSocket" in window)) return;
    var list = qs("[data-live-list]");
    if (list) initList(list);
    var header = qs("[data-live-task]");
    if (header) initDetail(header);
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init);
  else init();
})();
