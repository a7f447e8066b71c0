"""The web console in a real headless Chromium (Debian's `chromium` and `chromium-driver`,
driven by Selenium), against the example gateway binary in mock mode with the admin API on.

A second gateway process on the same database calls a provider that cannot answer, so that the
console has a refunded call with its error to show. Screenshots of every page at phone and
desktop width are written under target/console-screenshots (CI artifacts, not committed).
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.common.exceptions import NoAlertPresentException, StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions as EC
from selenium.webdriver.support.ui import Select, WebDriverWait

ROOT = Path(__file__).resolve().parents[2]
GATEWAY_BIN = os.environ.get("GATEWAY_BIN", str(ROOT / "target" / "debug" / "examples" / "gateway"))
SHOTS = ROOT / "target" / "console-screenshots"
TOKEN = "console-admin-token-0123456789"
XSS = "<img src=x onerror=alert(1)>"
PHONE, DESKTOP = (390, 844), (1280, 900)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(env):
    server = subprocess.Popen([GATEWAY_BIN, "serve"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    host, port = env["GATEWAY_LISTEN"].split(":")
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            return server
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"gateway did not start: {server.stderr.read().decode()}")
            time.sleep(0.1)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    db = tmp_path_factory.mktemp("console") / "gateway.db"
    # Two gateways on one file (one mock, one failing), so the file is served shared.
    base_env = {**os.environ, "DATABASE_URL": f"sqlite://{db}?mode=rwc", "GATEWAY_SQLITE_SHARED": "1"}
    env = {**base_env, "MOCK_UPSTREAM": "1", "GATEWAY_ADMIN_TOKEN": TOKEN, "GATEWAY_LISTEN": f"127.0.0.1:{free_port()}"}
    # Real providers with no key: every call fails upstream and is refunded.
    failing_env = {**base_env, "OPENAI_API_KEY": "", "GATEWAY_LISTEN": f"127.0.0.1:{free_port()}"}
    mock, failing = serve(env), serve(failing_env)

    class Gateway:
        base = f"http://{env['GATEWAY_LISTEN']}"
        failing_base = f"http://{failing_env['GATEWAY_LISTEN']}"

        @staticmethod
        def command(*args):
            return subprocess.run([GATEWAY_BIN, *args], env=env, capture_output=True, text=True, check=True).stdout

        @staticmethod
        def new_key(subscription):
            return Gateway.command("keys", "create", "--subscription", str(subscription)).strip().splitlines()[-1]

    yield Gateway
    for server in (mock, failing):
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=10) == 0
    audited = subprocess.run([GATEWAY_BIN, "audit"], env=env, capture_output=True, text=True)
    assert audited.returncode == 0, audited.stdout + audited.stderr


def chromium_binary():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.fail("Chromium is not installed (.ci/run installs Debian's chromium)")


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = chromium_binary()
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(argument)
    driver_path = shutil.which("chromedriver") or "/usr/bin/chromedriver"
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=driver_path))
    driver.set_window_size(*DESKTOP)
    yield driver
    driver.quit()


def call(base, key, model="gpt-4o-mini", path="/v1/chat/completions", body=None):
    body = body or {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    request = urllib.request.Request(
        f"{base}{path}",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {key}", "content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request) as answer:
            return answer.status
    except urllib.error.HTTPError as error:
        return error.code


def wait_text(driver, element_id, text):
    WebDriverWait(driver, 10).until(EC.text_to_be_present_in_element((By.ID, element_id), text))


def screenshots(driver, name):
    SHOTS.mkdir(parents=True, exist_ok=True)
    for label, size in (("phone", PHONE), ("desktop", DESKTOP)):
        driver.set_window_size(*size)
        time.sleep(0.2)
        driver.save_screenshot(str(SHOTS / f"{name}-{label}.png"))
        # The page fits the width: nothing forces a sideways scroll of the whole page.
        overflow = driver.execute_script("return document.documentElement.scrollWidth - window.innerWidth")
        assert overflow <= 1, f"{name} at {label} width is {overflow}px too wide"
    driver.set_window_size(*DESKTOP)


def sign_in(driver, url, field, secret):
    driver.get(url)
    driver.execute_script("sessionStorage.clear(); localStorage.clear()")
    driver.get(url)
    box = driver.find_element(By.ID, field)
    box.clear()
    box.send_keys(secret)
    driver.find_element(By.CSS_SELECTOR, "#sign-in button[type=submit]").click()


def test_the_pages_forbid_inline_scripts(gateway):
    for path in ("/console/", "/console/admin", "/console/keyholder.js"):
        with urllib.request.urlopen(gateway.base + path) as answer:
            policy = answer.headers["content-security-policy"]
            assert "script-src 'self'" in policy and "unsafe-inline" not in policy, policy


def test_a_wrong_key_is_told_why(gateway, browser):
    sign_in(browser, gateway.base + "/console/", "key", "sk-mg-not-a-key")
    wait_text(browser, "sign-in-error", "无效的 API Key")
    assert browser.find_element(By.ID, "account").is_displayed() is False


def test_a_key_holder_sees_balance_usage_and_calls_update(gateway, browser):
    key = gateway.new_key(100)
    sign_in(browser, gateway.base + "/console/", "key", key)
    wait_text(browser, "total", "100")
    assert browser.find_element(By.ID, "no-calls").is_displayed()
    assert browser.execute_script("return sessionStorage.getItem('mg_key')") == key
    assert browser.execute_script("return localStorage.getItem('mg_key')") is None

    for _ in range(3):
        assert call(gateway.base, key) == 200
    assert call(gateway.failing_base, key) == 502  # refunded, with its error
    browser.find_element(By.ID, "refresh").click()
    wait_text(browser, "total", str(100 - 3 * 2))
    rows = browser.find_elements(By.CSS_SELECTOR, "#calls tr")
    assert len(rows) == 4
    refunded = rows[0].find_elements(By.TAG_NAME, "td")
    assert refunded[5].text == "refunded"
    assert refunded[7].text != "", "the refunded call shows its upstream error"
    assert [r.find_elements(By.TAG_NAME, "td")[5].text for r in rows[1:]] == ["ok"] * 3
    # The chart has today's bar, the legend its model.
    assert browser.find_elements(By.CSS_SELECTOR, "#chart rect")
    assert "gpt-4o-mini" in browser.find_element(By.ID, "legend").text
    assert browser.find_element(By.ID, "chart-max").text == "6", "credits per day"
    Select(browser.find_element(By.ID, "measure")).select_by_value("calls")
    assert browser.find_element(By.ID, "chart-max").text == "3", "billed calls per day"

    browser.find_element(By.ID, "language").click()
    wait_text(browser, "sign-out", "Sign out")
    screenshots(browser, "keyholder")
    browser.find_element(By.ID, "language").click()

    browser.find_element(By.ID, "sign-out").click()
    assert browser.execute_script("return sessionStorage.getItem('mg_key')") is None
    assert browser.find_element(By.ID, "sign-in-panel").is_displayed()
    screenshots(browser, "sign-in")


def test_the_calls_table_shows_each_calls_protocol(gateway, browser):
    key = gateway.new_key(100)
    assert call(gateway.base, key) == 200
    assert call(gateway.base, key, path="/v1/responses", body={"model": "gpt-4o-mini", "input": "hi"}) == 200
    embeddings = {"model": "text-embedding-3-small", "input": "hi"}
    assert call(gateway.base, key, path="/v1/embeddings", body=embeddings) == 200
    sign_in(browser, gateway.base + "/console/", "key", key)
    wait_text(browser, "total", str(100 - 2 - 2 - 1))
    rows = browser.find_elements(By.CSS_SELECTOR, "#calls tr")
    protocols = [row.find_elements(By.TAG_NAME, "td")[2].text for row in rows]
    assert protocols == ["embeddings", "responses", "chat_completions"]
    browser.find_element(By.ID, "sign-out").click()


def test_a_key_holder_sees_the_prices_and_a_token_priced_calls_tokens(gateway, browser):
    key = gateway.new_key(100)
    assert call(gateway.base, key, model="gpt-4.1-mini") == 200
    sign_in(browser, gateway.base + "/console/", "key", key)
    wait_text(browser, "total", "99")
    [entry] = browser.find_elements(By.CSS_SELECTOR, "#calls tr")
    cells = [cell.text for cell in entry.find_elements(By.TAG_NAME, "td")]
    # Charged one credit; the mock's usage: the input estimated from the request, 16 out.
    assert cells[1:4] == ["gpt-4.1-mini", "chat_completions", "1"]
    assert cells[4].startswith("输入 ") and "输出 16" in cells[4], cells[4]
    prices = {
        row.find_elements(By.TAG_NAME, "td")[0].text: row.find_elements(By.TAG_NAME, "td")[2].text
        for row in browser.find_elements(By.CSS_SELECTOR, "#models tr")
    }
    assert prices["gpt-4o-mini"] == "2 每次"
    assert prices["gpt-4.1-mini"] == "输入 40 / 输出 160 / 缓存读 10 / 缓存写 40 每百万 Token"
    browser.find_element(By.ID, "language").click()
    wait_text(browser, "sign-out", "Sign out")
    # The tables are drawn again in the language chosen.
    WebDriverWait(browser, 10).until(
        lambda d: "out 16" in d.find_element(By.CSS_SELECTOR, "#calls tr").find_elements(By.TAG_NAME, "td")[4].text
    )
    browser.find_element(By.ID, "language").click()
    browser.find_element(By.ID, "sign-out").click()


def test_an_operator_creates_grants_and_revokes_and_names_stay_text(gateway, browser):
    sign_in(browser, gateway.base + "/console/admin", "token", "wrong-token-wrong-token")
    wait_text(browser, "sign-in-error", "无效的管理员令牌")
    sign_in(browser, gateway.base + "/console/admin", "token", TOKEN)
    WebDriverWait(browser, 10).until(EC.visibility_of_element_located((By.ID, "console")))

    browser.find_element(By.ID, "new-name").send_keys(XSS)
    browser.find_element(By.ID, "new-subscription").send_keys("5")
    browser.find_element(By.CSS_SELECTOR, "#create-account button").click()
    WebDriverWait(browser, 10).until(EC.visibility_of_element_located((By.ID, "created-key")))
    key = browser.find_element(By.ID, "created-key-value").text
    assert key.startswith("sk-mg-")
    assert call(gateway.base, key) == 200

    WebDriverWait(browser, 10, ignored_exceptions=(StaleElementReferenceException,)).until(
        lambda d: any(XSS == cell.text for cell in d.find_elements(By.CSS_SELECTOR, "#accounts td"))
    )
    assert not browser.find_elements(By.CSS_SELECTOR, "#accounts img"), "the name became HTML"
    with pytest.raises(NoAlertPresentException):
        browser.switch_to.alert.text
    screenshots(browser, "admin-accounts")

    # Search by name, then open the account.
    browser.find_element(By.ID, "search").send_keys("onerror")
    WebDriverWait(browser, 10).until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#accounts tr")) == 1)
    # The list is drawn again as each typed letter's search answers: a row found may be
    # replaced before it is clicked, so click until a row found is still there.
    WebDriverWait(browser, 10, ignored_exceptions=(StaleElementReferenceException,)).until(
        lambda d: d.find_element(By.CSS_SELECTOR, "#accounts tr").click() or True
    )
    wait_text(browser, "account-name", XSS)
    wait_text(browser, "total", "3")

    browser.find_element(By.ID, "grant-credits").send_keys("40")
    Select(browser.find_element(By.ID, "grant-bucket")).select_by_value("topup")
    browser.find_element(By.CSS_SELECTOR, "#grant button").click()
    wait_text(browser, "total", "43")
    wait_text(browser, "topup", "40")

    browser.find_element(By.ID, "new-key").click()
    WebDriverWait(browser, 10).until(EC.visibility_of_element_located((By.ID, "new-key-once")))
    second = browser.find_element(By.ID, "new-key-once-value").text
    assert call(gateway.base, second) == 200
    screenshots(browser, "admin-account")

    # Revoke the first key, confirming the dialog.
    revoke = browser.find_elements(By.CSS_SELECTOR, "#keys button.danger")[0]
    revoke.click()
    browser.switch_to.alert.accept()
    WebDriverWait(browser, 10).until(lambda d: "revoked" in d.find_element(By.ID, "keys").text)
    assert call(gateway.base, key) == 401
    assert call(gateway.base, second) == 200

    browser.find_element(By.ID, "back").click()
    browser.find_element(By.ID, "audit").click()
    wait_text(browser, "audit-result", "账目平衡")


def test_an_operator_sells_codes_and_a_key_holder_redeems_one(gateway, browser):
    sign_in(browser, gateway.base + "/console/admin", "token", TOKEN)
    WebDriverWait(browser, 10).until(EC.visibility_of_element_located((By.ID, "console")))
    browser.find_element(By.ID, "codes-count").send_keys("2")
    browser.find_element(By.ID, "codes-credits").send_keys("25")
    browser.find_element(By.ID, "codes-label").send_keys(XSS)
    browser.find_element(By.CSS_SELECTOR, "#create-codes button").click()
    WebDriverWait(browser, 10).until(EC.visibility_of_element_located((By.ID, "created-codes")))
    codes = browser.find_element(By.ID, "created-codes-value").text.split("\n")
    assert len(codes) == 2 and all(code.startswith("MG-") for code in codes), codes

    def batch_row(d):
        for tr in d.find_elements(By.CSS_SELECTOR, "#code-batches tr"):
            cells = [td.text for td in tr.find_elements(By.TAG_NAME, "td")]
            if cells[1] == XSS:
                return cells
        return None

    row = WebDriverWait(browser, 10, ignored_exceptions=(StaleElementReferenceException,)).until(batch_row)
    assert row[2:7] == ["25", "充值积分", "0", "2", "0"], row
    assert not browser.find_elements(By.CSS_SELECTOR, "#code-batches img"), "the label became HTML"
    screenshots(browser, "admin-codes")

    # The key holder redeems one code (typed in lower case), then tries it again.
    key = gateway.new_key(10)
    sign_in(browser, gateway.base + "/console/", "key", key)
    wait_text(browser, "total", "10")
    browser.find_element(By.ID, "redeem-code").send_keys(codes[0].lower())
    browser.find_element(By.CSS_SELECTOR, "#redeem button").click()
    wait_text(browser, "redeem-result", "已兑换积分: 25")
    wait_text(browser, "total", "35")
    wait_text(browser, "topup", "25")
    browser.find_element(By.ID, "redeem-code").send_keys(codes[0])
    browser.find_element(By.CSS_SELECTOR, "#redeem button").click()
    wait_text(browser, "redeem-result", "兑换码无效")
    assert browser.find_element(By.ID, "total").text == "35"
    screenshots(browser, "keyholder-redeem")
    browser.find_element(By.ID, "sign-out").click()

    # The operator sees one used, and revokes the other.
    sign_in(browser, gateway.base + "/console/admin", "token", TOKEN)
    row = WebDriverWait(browser, 10, ignored_exceptions=(StaleElementReferenceException,)).until(batch_row)
    assert row[4:7] == ["1", "1", "0"], row
    for tr in browser.find_elements(By.CSS_SELECTOR, "#code-batches tr"):
        if tr.find_elements(By.TAG_NAME, "td")[1].text == XSS:
            tr.find_element(By.CSS_SELECTOR, "button.danger").click()
            break
    browser.switch_to.alert.accept()
    WebDriverWait(browser, 10, ignored_exceptions=(StaleElementReferenceException,)).until(
        lambda d: (batch_row(d) or [None] * 7)[4:7] == ["1", "0", "1"]
    )
    request = urllib.request.Request(
        gateway.base + "/v1/redeem",
        data=json.dumps({"code": codes[1]}).encode(),
        headers={"Authorization": f"Bearer {key}", "content-type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request)
    assert refused.value.code == 400


def open_account(browser, prefix):
    """On the signed-in admin console, opens the one account whose key starts with `prefix`."""
    WebDriverWait(browser, 10).until(EC.visibility_of_element_located((By.ID, "console")))
    browser.find_element(By.ID, "search").send_keys(prefix)
    WebDriverWait(browser, 10).until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#accounts tr")) == 1)
    WebDriverWait(browser, 10, ignored_exceptions=(StaleElementReferenceException,)).until(
        lambda d: d.find_element(By.CSS_SELECTOR, "#accounts tr").click() or True
    )


def test_an_operator_sets_an_accounts_low_balance_alert(gateway, browser):
    key = gateway.new_key(100)
    sign_in(browser, gateway.base + "/console/admin", "token", TOKEN)
    open_account(browser, key[:12])
    wait_text(browser, "low-balance", "网关默认值")
    browser.find_element(By.ID, "low-balance-credits").send_keys("30")
    browser.find_element(By.CSS_SELECTOR, "#low-balance-form button[type=submit]").click()
    wait_text(browser, "low-balance", "30")
    screenshots(browser, "admin-low-balance")
    account = browser.execute_script("return current;")
    with urllib.request.urlopen(
        urllib.request.Request(
            f"{gateway.base}/admin/accounts/{account}",
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
    ) as answer:
        assert json.load(answer)["low_balance_credits"] == 30
    browser.find_element(By.ID, "default-low-balance").click()
    wait_text(browser, "low-balance", "网关默认值")


def test_an_operator_limits_a_key_and_its_holder_sees_the_limit(gateway, browser):
    key = gateway.new_key(100)
    sign_in(browser, gateway.base + "/console/admin", "token", TOKEN)
    prefix = key[:12]
    open_account(browser, prefix)
    wait_text(browser, "total", "100")
    browser.find_element(By.ID, "limit-credits").send_keys("4")
    Select(browser.find_element(By.ID, "limit-period")).select_by_value("day")
    browser.find_element(By.CSS_SELECTOR, "#key-limit button[type=submit]").click()
    WebDriverWait(browser, 10).until(lambda d: "0 / 4 每天" in d.find_element(By.ID, "keys").text)
    screenshots(browser, "admin-key-limit")

    # Two calls of 2 credits reach the limit; the third is refused with the key's own 402.
    assert call(gateway.base, key) == 200
    assert call(gateway.base, key) == 200
    assert call(gateway.base, key) == 402
    sign_in(browser, gateway.base + "/console/", "key", key)
    wait_text(browser, "total", "96")
    assert browser.find_element(By.ID, "key-limit-card").is_displayed()
    wait_text(browser, "key-limit", "4 / 4 每天")
    assert browser.find_element(By.ID, "key-limit-resets").text.startswith("重置于 ")
    screenshots(browser, "keyholder-key-limit")
    browser.find_element(By.ID, "sign-out").click()

    # Lifted from the console: the key calls again.
    sign_in(browser, gateway.base + "/console/admin", "token", TOKEN)
    open_account(browser, prefix)
    WebDriverWait(browser, 10).until(lambda d: "4 / 4 每天" in d.find_element(By.ID, "keys").text)
    browser.find_element(By.ID, "lift-limit").click()
    WebDriverWait(browser, 10).until(lambda d: "每天" not in d.find_element(By.ID, "keys").text)
    assert call(gateway.base, key) == 200


def admin_api(gateway, path, body):
    request = urllib.request.Request(
        gateway.base + path,
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {TOKEN}", "content-type": "application/json"},
    )
    with urllib.request.urlopen(request) as answer:
        return json.load(answer)


def test_a_search_shows_the_answer_to_what_was_typed_last(gateway, browser):
    for name in ("Nora", "Nora Quill"):
        admin_api(gateway, "/admin/accounts", {"name": name})
    sign_in(browser, gateway.base + "/console/admin", "token", TOKEN)
    WebDriverWait(browser, 10).until(EC.visibility_of_element_located((By.ID, "console")))
    # The answer to the first letter typed is held back until after the others', as a slow
    # network or a busy server can do; the page counts it once it has been handed over.
    browser.execute_script(
        """
        const answer = admin;
        window.lateAnswers = 0;
        admin = async (path, options) => {
          const page = await answer(path, options);
          if (path.endsWith("&search=N")) {
            await new Promise((resolve) => setTimeout(resolve, 1000));
            window.lateAnswers += 1;
          }
          return page;
        };
        """
    )
    browser.find_element(By.ID, "search").send_keys("Nora Quill")

    def names(driver):
        return [tr.find_elements(By.TAG_NAME, "td")[1].text for tr in driver.find_elements(By.CSS_SELECTOR, "#accounts tr")]

    WebDriverWait(browser, 10, ignored_exceptions=(StaleElementReferenceException,)).until(
        lambda d: d.execute_script("return window.lateAnswers") == 1
    )
    # The late answer ("N": both accounts, and any other with an n) came after the last one
    # and is not drawn over it.
    assert names(browser) == ["Nora Quill"]


def test_a_refresh_answered_late_is_not_drawn_over_a_later_one(gateway, browser):
    key = gateway.new_key(50)
    sign_in(browser, gateway.base + "/console/", "key", key)
    wait_text(browser, "total", "50")
    # While `slow` is set, the answers asked for are held back a second, and counted once
    # handed over to the page.
    browser.execute_script(
        """
        const answer = callApi;
        window.slow = false;
        window.lateAnswers = 0;
        callApi = async (secret, path, options) => {
          const late = window.slow;
          const page = await answer(secret, path, options);
          if (late) {
            await new Promise((resolve) => setTimeout(resolve, 1000));
            window.lateAnswers += 1;
          }
          return page;
        };
        window.slow = true;
        """
    )
    browser.find_element(By.ID, "refresh").click()  # asks while the balance is 50: held back
    browser.execute_script("window.slow = false")
    assert call(gateway.base, key) == 200
    browser.find_element(By.ID, "refresh").click()
    wait_text(browser, "total", "48")
    # A refresh asks four things: balance, usage, calls and models.
    WebDriverWait(browser, 10).until(lambda d: d.execute_script("return window.lateAnswers") == 4)
    assert browser.find_element(By.ID, "total").text == "48", "the older answer was drawn last"
    assert len(browser.find_elements(By.CSS_SELECTOR, "#calls tr")) == 1
