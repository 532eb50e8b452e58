// dllm-jax playground: chat through /v1/chat/completions with stream_provisional, and show the block being
// denoised live. Plain JS, no dependencies. The API key, when the server wants one, is asked once and kept in
// sessionStorage (this tab only).
"use strict";

(() => {
  const KEY = "dllm-jax.api-key";
  const PLACEHOLDER = "·";
  const $ = (id) => document.getElementById(id);
  const state = { messages: [], controller: null, frames: 0, blockView: null };
  window.dllmPlayground = state; // for debugging from the console

  // -- API key and requests -------------------------------------------------------------------------------
  const apiKey = () => sessionStorage.getItem(KEY) || "";
  let keyPrompt = null;

  function askKey(refused) {
    if (!keyPrompt) {
      keyPrompt = new Promise((resolve) => {
        const dialog = $("key-dialog");
        $("key-error").hidden = !refused;
        $("key-form").onsubmit = (ev) => {
          ev.preventDefault();
          sessionStorage.setItem(KEY, $("api-key").value.trim());
          dialog.close();
          keyPrompt = null;
          resolve();
        };
        dialog.showModal();
        $("api-key").focus();
      });
    }
    return keyPrompt;
  }

  async function api(path, init = {}) {
    for (;;) {
      const headers = { "Content-Type": "application/json" };
      if (apiKey()) headers.Authorization = "Bearer " + apiKey();
      const r = await fetch(path, { ...init, headers });
      if (r.status !== 401) return r;
      await askKey(Boolean(apiKey()));
    }
  }

  async function* sseEvents(body) {
    const reader = body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (line.startsWith("data: ")) yield line.slice(6);
        }
      }
    }
  }

  // -- model info -------------------------------------------------------------------------------------------
  async function loadInfo() {
    const r = await api("/get_model_info");
    if (!r.ok) {
      setStatus("error", `model info: HTTP ${r.status}`);
      return;
    }
    const info = await r.json();
    $("info-model").textContent = info.served_model_name || info.model_path;
    const config = Object.entries(info.algorithm_config || {}).map(([k, v]) => `${k} ${v}`).join(", ");
    $("info-algorithm").textContent = info.algorithm + (config ? ` (${config})` : "");
    $("info-block").textContent = String(info.block_size);
    $("info-schedule").textContent = info.schedule;
  }

  // -- the live block ---------------------------------------------------------------------------------------
  function show(piece) {
    if (piece === null || piece === undefined) return PLACEHOLDER;
    if (piece === "") return "∅";
    return piece.replace(/\n/g, "⏎");
  }

  function cells(count) {
    const grid = $("block");
    if (grid.children.length !== count) {
      const list = [];
      for (let i = 0; i < count; i++) list.push(document.createElement("span"));
      grid.replaceChildren(...list);
    }
    return grid.children;
  }

  function setCell(cell, cls, text, title) {
    cell.className = "cell " + cls;
    cell.textContent = text;
    cell.title = title;
  }

  function stats(b) {
    $("stat-tokens").textContent = String(b.completion_tokens);
    $("stat-forwards").textContent = String(b.forward_passes);
    $("stat-tpf").textContent = b.forward_passes ? (b.completion_tokens / b.forward_passes).toFixed(2) : "–";
  }

  function showProvisional(b) {
    const prev = state.blockView && state.blockView.offset === b.offset ? state.blockView : null;
    const row = cells(b.tokens.length);
    b.tokens.forEach((token, i) => {
      const title = `position ${b.offset + i}: token ${token}`;
      if (b.masked[i]) setCell(row[i], "masked", PLACEHOLDER, title + " (masked)");
      else if (b.immutable[i]) setCell(row[i], "fixed", show(b.pieces && b.pieces[i]), title);
      else {
        const fresh = !prev || prev.masked[i];
        setCell(row[i], "decided" + (fresh ? " fresh" : ""), show(b.pieces && b.pieces[i]), title);
      }
    });
    state.blockView = b;
    state.frames += 1;
    const grid = $("block");
    grid.dataset.state = "provisional";
    grid.dataset.offset = String(b.offset);
    $("stat-offset").textContent = String(b.offset);
    $("stat-step").textContent = String(b.step);
    $("stat-frames").textContent = String(state.frames);
    stats(b);
  }

  function showCommitted(b) {
    const view = state.blockView;
    const ids = b.output_ids || [];
    const pieces = b.pieces || ids.map(() => null);
    if (view && $("block").dataset.state === "provisional") {
      // the committed ids fill the open (not prompt / earlier) positions of the block shown, in order
      const row = cells(view.tokens.length);
      let k = 0;
      view.tokens.forEach((_, i) => {
        if (view.immutable[i]) return;
        const title = `position ${view.offset + i}`;
        if (k < ids.length) setCell(row[i], "committed", show(pieces[k]), `${title}: token ${ids[k]} (committed)`);
        else setCell(row[i], "dropped", "", `${title}: not used (the answer ended)`);
        k += 1;
      });
    } else if (ids.length) {
      // the block was decided in one forward: no provisional view of it was sent
      const row = cells(ids.length);
      ids.forEach((id, i) => setCell(row[i], "committed", show(pieces[i]), `token ${id} (committed)`));
      $("stat-offset").textContent = "–";
      $("stat-step").textContent = "1";
    }
    $("block").dataset.state = "committed";
    state.blockView = null;
    stats(b);
  }

  // -- chat -------------------------------------------------------------------------------------------------
  function setStatus(kind, text) {
    const s = $("status");
    s.dataset.state = kind;
    s.textContent = text;
  }

  function addMessage(role, text) {
    const li = document.createElement("li");
    li.className = role;
    li.textContent = text;
    $("transcript").append(li);
    li.scrollIntoView({ block: "end" });
    return li;
  }

  function busy(on) {
    $("send").disabled = on;
    $("clear").disabled = on;
    $("stop").disabled = !on;
  }

  async function send(ev) {
    ev.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || state.controller) return;
    $("prompt").value = "";
    state.messages.push({ role: "user", content: text });
    addMessage("user", text);
    const li = addMessage("assistant", "");
    li.dataset.state = "streaming";
    const body = {
      messages: state.messages.slice(),
      max_tokens: parseInt($("max-tokens").value, 10) || 128,
      temperature: Number($("temperature").value) || 0,
      stream: true,
      stream_provisional: true,
    };
    state.controller = new AbortController();
    state.frames = 0;
    busy(true);
    setStatus("streaming", "generating…");
    let content = "";
    let finish = null;
    try {
      const r = await api("/v1/chat/completions",
        { method: "POST", body: JSON.stringify(body), signal: state.controller.signal });
      if (!r.ok) {
        const err = await r.json().catch(() => ({}));
        throw new Error((err.error && err.error.message) || `HTTP ${r.status}`);
      }
      for await (const data of sseEvents(r.body)) {
        if (data === "[DONE]") break;
        const event = JSON.parse(data);
        if (event.error) throw new Error(event.error.message);
        for (const choice of event.choices || []) {
          const delta = choice.delta || {};
          if (delta.content) {
            content += delta.content;
            li.textContent = content;
          }
          const block = delta.dllm_block;
          if (block) (block.provisional ? showProvisional : showCommitted)(block);
          if (choice.finish_reason) finish = choice.finish_reason;
        }
      }
      state.messages.push({ role: "assistant", content });
      li.dataset.state = "done";
      setStatus("done", `done: ${finish || "?"}, ${state.frames} provisional frame(s)`);
    } catch (err) {
      state.messages.pop(); // the turn did not happen
      li.dataset.state = "failed";
      if (err.name === "AbortError") {
        setStatus("stopped", "stopped");
      } else {
        li.classList.add("error");
        li.textContent = content + (content ? "\n" : "") + `[${err.message}]`;
        setStatus("error", err.message);
      }
    } finally {
      state.controller = null;
      busy(false);
    }
  }

  $("chat-form").addEventListener("submit", send);
  $("prompt").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey) {
      ev.preventDefault();
      $("chat-form").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("clear").addEventListener("click", () => {
    state.messages = [];
    $("transcript").replaceChildren();
    $("block").replaceChildren();
    $("block").dataset.state = "empty";
    setStatus("idle", "");
  });
  loadInfo().catch((err) => setStatus("error", err.message));
})();
