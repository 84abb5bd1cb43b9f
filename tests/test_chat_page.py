"""The chat page at /, driven by headless Chromium against a real server on loopback.

Debian's chromium through Debian's chromium-driver (selenium): both come from one source package,
so the driver always speaks the browser's protocol version, and nothing is downloaded at run time
(the Makefile installs them). The tiny random model's context is long enough that a reply left
running would take many seconds, so a Stop that does not reach the engine shows as a failure.
"""

import os
import time

import httpx
import openai
import pytest

from builders import build_model, save_tokenizer
from chitu_core.engine.async_engine import AsyncLLM
from chitu_core.server.app import build_app
from serving import LiveServer, cpu_engine

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
pytestmark = pytest.mark.skipif(
    not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)),
    reason=f"no {CHROMIUM} and {CHROMEDRIVER}: apt-get install chromium chromium-driver (make test does)")

from selenium import webdriver  # noqa: E402  (after the skip: the reason above is the useful one)
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

MODEL = "tiny-chat"
KEY = "sk-page-key"
# As root on a machine without network: no sandbox, no GPU, nothing that phones home.
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1100,800"]
# ~1 s of streaming on a CPU: long enough that the browser sees the reply in several reads.
REPLY = 300
LAST_REPLY = "document.querySelector('#messages .msg.assistant:last-child')"


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("page-llama")
    build_model(path, "llama-tied", bos_token_id=0, eos_token_id=1, max_position_embeddings=8192)
    save_tokenizer(path)
    with cpu_engine(path) as engine:
        yield engine


@pytest.fixture(scope="module")
def server(llm):
    with LiveServer(build_app(llm, [MODEL])) as live:
        yield live


@pytest.fixture(scope="module")
def keyed(llm):
    with LiveServer(build_app(llm, [MODEL], api_keys=[KEY])) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused")


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS + [f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def wait(driver, what, timeout=20.0):
    return WebDriverWait(driver, timeout, poll_frequency=0.02).until(what)


def open_page(driver, url: str, models: bool = True) -> None:
    """The page with no saved settings; ``models``: wait until the model list has loaded."""
    driver.get(url + "/")
    driver.execute_script("localStorage.clear()")
    driver.get(url + "/")
    if models:
        wait(driver, lambda d: d.execute_script("return document.getElementById('model').options.length") > 0)


def set_settings(driver, **values) -> None:
    details = driver.find_element(By.ID, "settings")
    if not details.get_attribute("open"):
        details.find_element(By.TAG_NAME, "summary").click()
    for name, value in values.items():
        field = driver.find_element(By.ID, name)
        field.clear()
        field.send_keys(str(value))


def reply_state(driver) -> str | None:
    return driver.execute_script(f"const r = {LAST_REPLY}; return r && r.dataset.state")


def reply_text(driver) -> str:
    return driver.execute_script(f"return {LAST_REPLY}.querySelector('.content').textContent")


def record_reply_lengths(driver) -> None:
    """From now on, window.seen gets [length, state] of the last reply at every change of the conversation."""
    driver.execute_script("""
        window.seen = [];
        new MutationObserver(() => {
            const r = document.querySelector('#messages .msg.assistant:last-child');
            if (r) window.seen.push([r.querySelector('.content').textContent.length, r.dataset.state]);
        }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true, attributes: true});
    """)


def send(driver, text: str, enter: bool = False) -> None:
    box = driver.find_element(By.ID, "input")
    box.send_keys(text)
    if enter:
        box.send_keys(Keys.ENTER)
    else:
        driver.find_element(By.ID, "send").click()


def finished(driver, timeout=30.0) -> str:
    return wait(driver, lambda d: (s := reply_state(d)) in ("done", "stopped", "error") and s, timeout)


def engine_idle(llm: AsyncLLM, timeout: float) -> bool:
    """The engine has no requests and every KV block is free within ``timeout``."""
    bm = llm.engine.block_manager
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not llm.engine.requests and bm.num_free == bm.num_blocks:
            return True
        time.sleep(0.02)
    return False


def api_reply(client, messages, max_tokens: int) -> str:
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, top_p=1, max_tokens=max_tokens,
                                       extra_body={"ignore_eos": True})
    return r.choices[0].message.content


def test_page_and_assets_are_served_from_this_origin(server):
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
    assert "default-src 'self'" in page.headers["content-security-policy"]
    for asset, kind in (("chat.js", "javascript"), ("chat.css", "text/css"), ("favicon.svg", "image/svg+xml")):
        r = httpx.get(f"{server.url}/static/{asset}")
        assert r.status_code == 200 and kind in r.headers["content-type"], asset
    for text in (page.text, httpx.get(server.url + "/static/chat.js").text, httpx.get(server.url + "/static/chat.css").text):
        assert "http://" not in text and "https://" not in text  # nothing from another origin (no CDN, no fonts)
    assert httpx.get(server.url + "/static/missing.js").status_code == 404
    assert "/" not in httpx.get(server.url + "/openapi.json").json()["paths"]


def test_page_loads_without_console_errors(browser, server):
    open_page(browser, server.url)
    assert browser.title == "Chitu chat"
    assert browser.execute_script("return [...document.getElementById('model').options].map(o => o.value)") == [MODEL]
    unlabelled = browser.execute_script(
        "return [...document.querySelectorAll('input, select, textarea')].filter(e => !e.labels.length).map(e => e.id)")
    assert unlabelled == []
    assert browser.find_element(By.ID, "stop").get_attribute("disabled") == "true"
    assert browser.find_element(By.ID, "error").is_displayed() is False
    assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE"] == []
    browser.set_window_size(390, 844)  # a phone: nothing wider than the screen
    try:
        assert browser.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")
    finally:
        browser.set_window_size(1100, 800)


def test_streamed_replies_match_the_api_and_new_chat_clears(browser, server, client):
    open_page(browser, server.url)
    set_settings(browser, temperature=0, max_tokens=REPLY, extra='{"ignore_eos": true}')
    record_reply_lengths(browser)
    first = "What is the capital of France?"
    send(browser, first)
    assert finished(browser) == "done"
    text = reply_text(browser)
    assert text == api_reply(client, [{"role": "user", "content": first}], REPLY)
    seen = browser.execute_script("return window.seen")
    growing = sorted({n for n, state in seen if state == "streaming" and 0 < n < len(text)})
    assert len(growing) >= 2, seen  # the reply showed at least two partial lengths before it finished
    assert [n for n, _ in seen] == sorted(n for n, _ in seen)  # and only grew

    # Shift+Enter is a newline in the message; Enter sends it, with the conversation so far.
    box = browser.find_element(By.ID, "input")
    box.send_keys("line one", Keys.SHIFT, Keys.ENTER, Keys.SHIFT, "line two")
    assert box.get_attribute("value") == "line one\nline two"
    assert len(browser.find_elements(By.CSS_SELECTOR, "#messages .msg")) == 2
    box.send_keys(Keys.ENTER)
    assert finished(browser) == "done"
    history = [{"role": "user", "content": first}, {"role": "assistant", "content": text},
               {"role": "user", "content": "line one\nline two"}]
    assert reply_text(browser) == api_reply(client, history, REPLY)
    assert box.get_attribute("value") == ""

    browser.find_element(By.ID, "new-chat").click()
    assert browser.find_elements(By.CSS_SELECTOR, "#messages > *") == []
    assert browser.find_element(By.ID, "empty").is_displayed()
    send(browser, "hi", enter=True)
    assert finished(browser) == "done"
    assert reply_text(browser) == api_reply(client, [{"role": "user", "content": "hi"}], REPLY)  # no earlier turns sent
    assert len(browser.find_elements(By.CSS_SELECTOR, "#messages .msg")) == 2
    assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE"] == []


def test_stop_ends_the_stream_and_the_engine_request(browser, server, llm):
    open_page(browser, server.url)
    set_settings(browser, temperature=0, max_tokens=8000, extra='{"ignore_eos": true}')  # tens of seconds if left
    send(browser, "Tell me a long story.")
    wait(browser, lambda d: reply_state(d) == "streaming" and len(reply_text(d)) > 0)
    assert llm.engine.requests  # running now
    browser.find_element(By.ID, "stop").click()
    assert finished(browser, timeout=5) == "stopped"
    stopped_at = time.monotonic()
    assert engine_idle(llm, timeout=3), "the engine still runs the request the page stopped"
    assert time.monotonic() - stopped_at < 3
    length = len(reply_text(browser))
    time.sleep(0.5)
    assert len(reply_text(browser)) == length > 0  # stopped growing, and kept what came
    assert browser.execute_script(f"return {LAST_REPLY}.querySelector('.status').textContent") == "Stopped"
    assert browser.find_element(By.ID, "send").is_enabled() and not browser.find_element(By.ID, "stop").is_enabled()


def test_server_errors_are_shown(browser, keyed, client):
    open_page(browser, keyed.url, models=False)
    error = browser.find_element(By.ID, "error")
    wait(browser, lambda d: error.is_displayed())
    assert error.text == "Could not list the models: missing or invalid API key: send 'Authorization: Bearer <key>'"

    set_settings(browser, **{"api-key": KEY})
    browser.find_element(By.ID, "input").click()  # leaving the field saves the key and reloads the models
    wait(browser, lambda d: d.execute_script("return document.getElementById('model').options.length") == 1)
    assert not error.is_displayed()
    browser.refresh()  # the key is remembered
    wait(browser, lambda d: d.execute_script("return document.getElementById('model').options.length") == 1)
    assert browser.find_element(By.ID, "api-key").get_attribute("value") == KEY

    # A request the server refuses: its OpenAI-shaped message is shown, and the message is kept to send again.
    set_settings(browser, max_tokens=100000)
    send(browser, "too long")
    assert finished(browser) == "error"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "too long"}], "max_tokens": 100000, "stream": True}
    refused = httpx.post(keyed.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert refused.status_code == 400
    error = browser.find_element(By.ID, "error")
    assert error.is_displayed() and error.text == refused.json()["error"]["message"]
    assert browser.find_element(By.ID, "input").get_attribute("value") == "too long"
